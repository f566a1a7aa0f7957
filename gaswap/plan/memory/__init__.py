"""Models of device memory beyond live bytes: PyTorch's CUDA caching allocator and an arena's address plan."""
