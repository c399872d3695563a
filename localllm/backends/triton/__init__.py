"""The Triton backend: our own Triton kernels (`localllm/kernels/triton_*.py`) for quantized
matmuls, paged attention, the KV store and the fused small ops; compiled on a CUDA GPU, run by
Triton's interpreter on CPU tensors with TRITON_INTERPRET=1 (how it is tested without a GPU)."""

from localllm.backends.triton.backend import TritonBackend

__all__ = ["TritonBackend"]
