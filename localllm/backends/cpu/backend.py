"""`CpuBackend`: native C kernels (AVX-512 BF16 and AMX, or AVX2) where they run, PyTorch ops
elsewhere.

Whether the kernels run is asked at each call (`cpu_native.available()`), so a process that
turns them off (`LOCALLLM_NATIVE=0`, tests) takes the PyTorch path with the same weights:
quantized weights stay packed in the layout both PyTorch's int4 CPU kernel and ours read.
"""

from __future__ import annotations

import math
import mmap
from contextlib import AbstractContextManager

import torch

from localllm.backends.cpu import ops, weight_arena, whole_step
from localllm.backends.cpu.attention import CpuPagedAttention
from localllm.backends.cpu.dispatch import decode_rows, step_rows
from localllm.backends.cpu.packing import cpu_packable
from localllm.backends.cpu.weights import CpuInt8ChannelWeight, CpuPackedWeight
from localllm.backends.pytorch.backend import TorchBackend
from localllm.layers.attention import AttentionMetadata, KVCache
from localllm.layers.backend import DecodeSteps, Forward, WholeStep
from localllm.layers.ops import QuantWeight, RowSource
from localllm.layers.stack import DecoderLayout
from localllm.quant.formats import Int8Weight

FIRST_ROWS = 64  # rows read to decide whether a weight's format packs


class CpuBackend(TorchBackend):
    name = "cpu"

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self._attention = CpuPagedAttention()
        self._ops = ops

    def pack_linear(self, source: RowSource, out_features: int, dtype: torch.dtype,
                    exact_rows: bool) -> QuantWeight | None:
        first = source(0, min(out_features, FIRST_ROWS))
        if not cpu_packable(first, dtype):
            return None
        if isinstance(first, Int8Weight) and first.per_channel and first.offsets is None:
            whole = source(0, out_features)
            assert isinstance(whole, Int8Weight)
            return CpuInt8ChannelWeight(whole, dtype)
        return CpuPackedWeight.from_rows(source, out_features, dtype, exact_rows)

    def allocate_kv(self, num_layers: int, num_blocks: int, block_size: int,
                    num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> list[KVCache]:
        # NOTE: the pools live in one anonymous memory map: the kernel hands out zeroed pages
        # on first touch, so the cache is resident only as far as blocks are used, and an
        # unwritten slot reads as 0 (never NaN garbage that a mask could not cancel).
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        buf = mmap.mmap(-1, 2 * num_layers * math.prod(shape) * itemsize)
        flat = torch.frombuffer(buf, dtype=dtype)  # keeps `buf` alive
        pools = flat.view(num_layers, 2, *shape)
        return [KVCache(pools[i, 0], pools[i, 1]) for i in range(num_layers)]

    def settle_weights(self, model: torch.nn.Module) -> None:
        # the packed weights on 2 MiB pages, in one map (`weight_arena`)
        if weight_arena.enabled():
            weight_arena.gather(weight_arena.packed_weights(model))

    def decoding_rows(self, n: int) -> AbstractContextManager[None]:
        return decode_rows(n)

    def step_rows(self, meta: AttentionMetadata) -> AbstractContextManager[None]:
        # each prompt's rows take its whole length's path (`dispatch.row_groups`)
        if meta.prompt_lens is None:
            return super().step_rows(meta)
        return step_rows(meta.row_runs())

    def whole_step(self, layout: DecoderLayout, forward: Forward) -> WholeStep | None:
        return whole_step.build(layout)

    def decode_steps(self, layout: DecoderLayout) -> DecodeSteps | None:
        return whole_step.build_steps(layout)
