"""The inference proxy: a generic raw-bytes gRPC handler for every runtime method."""
