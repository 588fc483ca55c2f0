"""Any model into stages: tracing with torch.distributed.pipelining, flattening, model inputs."""
