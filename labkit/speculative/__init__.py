"""Speculative decoding: drafters behind a registry (labkit.speculative.base), verification and
per-request speculation state (labkit.speculative.verify). The scheduler's side is
labkit/scheduler/speculation.py; the rollback of rejected drafts' KV, labkit/scheduler/batch_memory.py.
Drafters load lazily: importing this package loads no drafter and no second model."""

from labkit.speculative.base import DRAFTERS, Drafter, DraftReq, drafter_names, get_drafter, register_drafter

__all__ = ["DRAFTERS", "DraftReq", "Drafter", "drafter_names", "get_drafter", "register_drafter"]
