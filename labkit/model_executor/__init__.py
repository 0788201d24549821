"""Model execution: ForwardBatch and the ModelRunner."""
