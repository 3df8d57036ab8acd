"""The control plane: token-checked grpc.aio servers and clients (``_grpc``), per-request
signatures (``_signing``) and mutual TLS (``_tls``)."""
