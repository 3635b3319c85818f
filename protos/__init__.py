"""Generated gRPC stubs of the gemma_serve.v1 API (see the .proto files beside them)."""
