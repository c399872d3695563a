"""Triton kernels, each beside its plain-PyTorch reference `*_ref` (GPU backend)."""
