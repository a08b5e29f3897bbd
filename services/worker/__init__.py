"""The prefill / decode / both worker process (`main.py`): one engine, the gRPC servicers of its
role (`moemesh.prefill.servicer`, `moemesh.decode.servicer`), health, metrics, registry
heartbeats and prefix-index events. Settings in `settings.py`."""
