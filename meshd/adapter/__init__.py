"""`meshd adapter`: a ModelRuntime (SPI) server in front of a KServe V2 model server that
speaks the model-repository extension (Triton in explicit model-control mode, MLServer)."""
