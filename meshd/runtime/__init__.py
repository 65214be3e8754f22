"""The ModelRuntime SPI client (meshd is the client) and its load queue."""
