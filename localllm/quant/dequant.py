"""Dequantization of one GGUF tensor to an fp32 torch tensor.

Types with a runtime format go through `localllm.quant.repack` (exact, vectorized); the rest
through `gguf.quants.dequantize`, so only files with other types import the `gguf` package.
"""

from __future__ import annotations

import numpy as np
import torch

from localllm.errors import ModelLoadError
from localllm.gguf.reader import TensorInfo
from localllm.gguf.types import GGMLType
from localllm.quant.repack import repack


def dequantize(info: TensorInfo, source: str = "") -> torch.Tensor:
    """Dequantize one tensor to fp32, shaped as PyTorch expects ([out, in] for matrices)."""
    try:
        packed = repack(info)
    except ValueError as e:
        raise ModelLoadError(f"{source}: tensor {info.name!r} cannot be decoded ({e})") from None
    if packed is not None:
        w = packed if isinstance(packed, torch.Tensor) else packed.dequantize()
        return w.float().reshape(info.shape)
    return _dequantize_gguf(info, source)


def _dequantize_gguf(info: TensorInfo, source: str) -> torch.Tensor:
    import gguf
    import gguf.quants

    try:
        qt = gguf.GGMLQuantizationType(info.qtype)
    except ValueError:
        raise ModelLoadError(
            f"{source}: tensor {info.name!r} has unknown GGML type {info.qtype}; the file is "
            "corrupt or needs a newer localllm"
        ) from None
    try:
        if qt in (GGMLType.F32, GGMLType.F16):
            arr = np.asarray(info.data, dtype=np.float32)
        else:
            arr = gguf.quants.dequantize(info.data, qt)
    except NotImplementedError:
        raise ModelLoadError(
            f"{source}: tensor {info.name!r} uses quant type {qt.name}, which localllm cannot "
            "load; requantize the model to Q4_K, Q5_K, Q6_K or Q8_0"
        ) from None
    except Exception as e:
        raise ModelLoadError(
            f"{source}: tensor {info.name!r} ({qt.name}) cannot be decoded ({e})"
        ) from None
    n = int(np.prod(info.shape))
    if arr.size != n:
        raise ModelLoadError(
            f"{source}: tensor {info.name!r} holds {arr.size} values, expected {n}"
        )
    arr = arr.reshape(info.shape)
    if not arr.flags.writeable or not arr.flags.c_contiguous:
        arr = np.array(arr, dtype=np.float32, order="C")  # out of the read-only memory map
    return torch.from_numpy(arr)
