"""Serving: requests in, tokens out, over the pool the replica keeps.

- admission.py: `AdmissionPort`, the one seam between serving and the replica: all that the
  engine asks of it, and the errors and grant that cross it
- engine.py: continuous batching; every request admitted in a pass over the queue is
  prefilled in one call

This package imports nothing at import time.
"""
