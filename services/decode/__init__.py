"""Decode worker: admits requests, gets KV from prefill workers or prefills locally, decodes; and the worker process runtime."""
