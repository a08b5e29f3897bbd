"""The inference core: requests, paged KV cache, scheduler, model runner, offline API."""
