"""Prefill worker: prefills prompts and streams their KV to decode workers."""
