"""The CPU backend: native C kernels (`localllm/kernels/cpu_*`) with PyTorch ops as fallback;
the only package that imports those kernels."""

from localllm.backends.cpu.backend import CpuBackend

__all__ = ["CpuBackend"]
