"""Decode worker: admits requests, gets KV from a prefill worker or prefills locally, decodes.

Also the worker process runtime (`worker.py`) shared by every prefill / decode / both worker.
"""
