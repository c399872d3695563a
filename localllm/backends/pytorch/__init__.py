"""PyTorch ops on any device: the backend of devices without kernels of our own."""
