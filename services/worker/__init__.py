"""The prefill / decode / both worker process (`main.py`): one engine, the gRPC servicers of its
role (`moemesh.worker.prefill_servicer`, `moemesh.worker.decode_servicer`), health, metrics, registry
heartbeats and prefix-index events. Settings in `settings.py`."""
