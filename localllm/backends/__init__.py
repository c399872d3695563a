"""Backends: one per way of running the model's ops, chosen once at load (`make_backend`).

- `cpu/`: the CPU backend (native C kernels with PyTorch ops as fallback).
- `triton/`: our Triton kernels, on a CUDA GPU (or CPU tensors under TRITON_INTERPRET=1).
- `pytorch/`: PyTorch ops on any device.

A new backend is a package here implementing `localllm.layers.backend.Backend`, and a name in
`BACKENDS` that `make_backend` builds.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from localllm.errors import RequestError
from localllm.layers.backend import Backend

DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "cpu", "triton", "torch")


def _device(device: str, backend: str) -> str:
    if device not in DEVICES:
        raise RequestError(f"unknown device {device!r} (choose from {', '.join(DEVICES)})")
    if backend not in BACKENDS:
        raise RequestError(f"unknown backend {backend!r} (choose from {', '.join(BACKENDS)})")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and backend != "cpu" else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RequestError("--device cuda: no CUDA GPU is usable here (torch.cuda."
                           "is_available() is False); use --device cpu or auto")
    return device


def make_backend(device: str = "auto", backend: str = "auto") -> Backend:
    """The backend for `device` ("auto": CUDA when `torch.cuda.is_available()`, else the CPU)
    and `backend` ("auto": the CPU backend on the CPU; on CUDA the Triton backend where
    triton is installed, else PyTorch ops). The Triton backend on the CPU needs
    TRITON_INTERPRET=1. A device or backend that cannot run here is a RequestError."""
    dev = _device(device, backend)
    if backend == "auto":
        if dev == "cpu":
            backend = "cpu"
        else:
            backend = "triton" if importlib.util.find_spec("triton") else "torch"
    if backend == "cpu":
        if dev != "cpu":
            raise RequestError("--backend cpu runs on the CPU only; use --device cpu")
        from localllm.backends.cpu import CpuBackend

        return CpuBackend()
    if backend == "triton":
        if importlib.util.find_spec("triton") is None:
            raise RequestError("--backend triton: triton is not installed "
                               "(pip install 'triton>=3.6')")
        # NOTE: checked before the kernels are imported: triton.jit decides then whether they
        # are interpreted or compiled
        if dev == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise RequestError("--backend triton on the CPU runs only under Triton's "
                               "interpreter: set TRITON_INTERPRET=1 (slow; for testing)")
        from localllm.backends.triton import TritonBackend

        return TritonBackend(torch.device(dev))
    from localllm.backends.pytorch.backend import TorchBackend

    return TorchBackend(torch.device(dev))
