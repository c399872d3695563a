"""Backends: one per kind of device, chosen once at load (`make_backend`).

- `cpu/`: the CPU backend (native C kernels with PyTorch ops as fallback).
- `pytorch/`: PyTorch ops on any device; the CUDA device runs on it for now.

A new backend is a package here implementing `localllm.layers.backend.Backend`, and a line in
`make_backend`.
"""

from __future__ import annotations

import torch

from localllm.errors import RequestError
from localllm.layers.backend import Backend

DEVICES = ("auto", "cpu", "cuda")


def make_backend(device: str = "auto") -> Backend:
    """The backend for `device`: `auto` takes CUDA when `torch.cuda.is_available()`, else the
    CPU. `cuda` without a usable GPU is a RequestError."""
    if device not in DEVICES:
        raise RequestError(f"unknown device {device!r} (choose from {', '.join(DEVICES)})")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RequestError("--device cuda: no CUDA GPU is usable here (torch.cuda."
                               "is_available() is False); use --device cpu or auto")
        from localllm.backends.pytorch.backend import TorchBackend

        return TorchBackend(torch.device("cuda"))
    from localllm.backends.cpu import CpuBackend

    return CpuBackend()
