"""Decode role: the DecodeWorker servicer (admit, get KV from a prefill worker or prefill locally, decode)."""
