"""Scheduling state with no tensors: requests, the scheduler, fair admission and KV block bookkeeping."""
