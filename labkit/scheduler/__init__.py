"""The scheduler: requests, batches, policies and the scheduling loop."""
