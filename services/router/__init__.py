"""Router: OpenAI-compatible HTTP + gRPC front door, tokenization, KV-aware routing."""
