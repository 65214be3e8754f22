"""gRPC servicers: thin conversions between messages and the core objects."""
