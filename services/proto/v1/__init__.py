"""Generated gRPC/protobuf stubs of proto/moemesh/v1 (regenerate: python proto/generate.py)."""
