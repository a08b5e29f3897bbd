"""Prefill role: the PrefillWorker servicer (prefill prompts, stream their KV to decode workers)."""
