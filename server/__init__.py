"""The production server (import path labkit.server)."""
