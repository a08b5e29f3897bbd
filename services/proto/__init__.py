"""gRPC contracts (generated from proto/)."""
