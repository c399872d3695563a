"""Which matmul a packed weight's rows take, by row count: the CPU backend's one policy table.

A packed matmul's rows are decoding tokens (the step's leading rows, `decode_rows`) or a
prompt's rows. Decoding rows always take the few-rows kernel, which computes every row the same
way whatever else shares its batch, so a request's tokens do not depend on its neighbours, even
when a long prompt shares the step. A batch of at most the first entry's row count runs wholly
on the kernel too; in a larger batch, the rows that are not decoding take the path their own
count picks as if they had the step alone: the kernel for at most the first entry's rows, else
the first later entry whose row count they fit (so a short prompt beside decoding rows is
computed as it is alone).

`ROW_POLICY[machine, kind]` lists (at most this many rows, path) in order. The machine is
`amx` (native kernels and AMX tiles), `native` (native kernels without AMX: the AVX-512 or
the AVX2 build) or `torch` (PyTorch's int4 kernel), or `any` for weights only PyTorch's int8
kernel takes. The
kind is, on the native machines, `codes` (groups of 32 without a codebook: AMX tiles read
their codes directly) or `other`; on `torch`, the planes (PyTorch's kernel runs them one at a
time, so two-plane weights leave it at half the rows); `int8 per channel` on `any`.
Measured on the default model, 2 cores:

- native kernel on the 3072x576 gate/up weight: 205 us at 8 rows, 395 us at 16, 578 us at 24
  vs 460 us dequantized; PyTorch's int4 kernel (per plane) 1.4 ms at 512 rows vs 5.2 ms
  dequantized, 28 us at 1 row;
- all 120 matrices, ms (kernel / codes on tiles / `int4_gemm`): 3 rows 8.8 / 8.6 / 15.5,
  8 rows 16.3 / 11.1 / 16.1, 32 rows 55.8 / 20.9 / 21.1, 64 rows 109 / 40.0 / 27.7;
- above 768 rows dequantize + PyTorch's matmul beats `int4_gemm` (gate/up: 1.23 vs 1.25 ms
  at 512 rows, 3.0 vs 1.9 at 1024; `int4_gemm`'s time grows linearly with the rows, and
  running K in L1-sized passes did not change that).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from localllm.kernels import cpu_native


class MatmulPath(enum.Enum):
    KERNEL = "kernel"  # the few-rows kernel: native int4_mm, else PyTorch's int4 kernel
    TILES = "tiles"  # AMX tiles on the packed codes (int4_mm(tiles=True))
    GEMM = "gemm"  # AMX tiles on dequantized weight tiles (int4_gemm)
    DENSE = "dense"  # the weight dequantized for the call, then PyTorch's bf16 matmul


K, T, G, D = MatmulPath.KERNEL, MatmulPath.TILES, MatmulPath.GEMM, MatmulPath.DENSE
GEMM_MAX_ROWS = 768
NATIVE_KERNEL_MAX_ROWS = 16
TORCH_KERNEL_MAX_ROWS = 64
Policy = tuple[tuple[float, MatmulPath], ...]
ROW_POLICY: dict[tuple[str, str], Policy] = {
    ("amx", "codes"): ((4, K), (32, T), (GEMM_MAX_ROWS, G), (math.inf, D)),
    ("amx", "other"): ((8, K), (GEMM_MAX_ROWS, G), (math.inf, D)),
    ("native", "codes"): ((NATIVE_KERNEL_MAX_ROWS, K), (math.inf, D)),
    ("native", "other"): ((NATIVE_KERNEL_MAX_ROWS, K), (math.inf, D)),
    ("torch", "1 plane"): ((TORCH_KERNEL_MAX_ROWS, K), (math.inf, D)),
    ("torch", "2 planes"): ((TORCH_KERNEL_MAX_ROWS // 2, K), (math.inf, D)),
    ("any", "int8 per channel"): ((TORCH_KERNEL_MAX_ROWS, K), (math.inf, D)),
}
# the MLP's gate and up write silu(gate) * up tile by tile (`int4_gemm(gated=True)`) for more
# rows than AMX tiles on the codes take
GATED_MIN_ROWS = 33

# how many leading rows of the batch in flight are decoding tokens (see the module docstring)
_DECODE_ROWS: ContextVar[int] = ContextVar("decode_rows", default=0)


@contextmanager
def decode_rows(n: int) -> Iterator[None]:
    """Within this block, the first `n` rows of every packed matmul are decoding tokens: they
    take the few-rows kernel whatever the batch size."""
    token = _DECODE_ROWS.set(n)
    try:
        yield
    finally:
        _DECODE_ROWS.reset(token)


def machine() -> str:
    """The `ROW_POLICY` machine of this process, as of now (tests switch the kernels off)."""
    if not cpu_native.available():
        return "torch"
    return "amx" if cpu_native.gemm_available() else "native"


def native_kernels() -> str:
    """Which native build runs here, in words ("AVX-512 BF16 + AMX prefill", "AVX2 FMA"), or
    why the kernels are off."""
    if not cpu_native.available():
        return f"off ({cpu_native.unavailable_reason() or 'the build failed'})"
    parts = [{"avx512": "AVX-512 BF16", "avx2": "AVX2 FMA"}.get(cpu_native.isa() or "", "?")]
    if cpu_native.gemm_available():
        parts.append("AMX prefill")
    if cpu_native.amx_enabled():
        parts.append("AMX decode")
    return " + ".join(parts)


def packed_policy(codes: bool, planes: int) -> Policy:
    """The row policy of a packed int4 weight of `planes` planes; `codes` as in the module
    docstring."""
    m = machine()
    if m == "torch":
        return ROW_POLICY[m, "1 plane" if planes == 1 else "2 planes"]
    return ROW_POLICY[m, "codes" if codes else "other"]


def rest_path(table: Policy, rows: int) -> MatmulPath:
    """The path of `rows` non-decoding rows of a batch larger than the kernel's limit."""
    return next(path for limit, path in table[1:] if rows <= limit)


def decoding_split(table: Policy, rows: int) -> int:
    """How many of a batch's `rows` leading rows take the kernel."""
    if rows <= table[0][0]:
        return rows
    return min(_DECODE_ROWS.get(), rows)


def split_matmul(x: torch.Tensor, table: Policy,
                 kernel: Callable[[torch.Tensor], torch.Tensor],
                 rest: Callable[[torch.Tensor, MatmulPath], torch.Tensor],
                 out_features: int) -> torch.Tensor:
    """x @ W.T through `kernel` for the rows `decoding_split` gives it; the others (a prompt's
    rows) take the path their own count picks, as they would in a step of their own: `kernel`
    for at most the first entry's rows, else `rest(rows, path)`. So a short prompt that joins
    decoding rows is computed as it is alone, and its request's tokens do not depend on them."""
    m = x.shape[0]
    d = decoding_split(table, m)
    if d == m:
        return kernel(x)

    def others(rows: torch.Tensor) -> torch.Tensor:
        n = rows.shape[0]
        return kernel(rows) if n <= table[0][0] else rest(rows, rest_path(table, n))

    if d == 0:
        return others(x)
    y = torch.empty(m, out_features, dtype=x.dtype, device=x.device)
    y[:d] = kernel(x[:d])
    y[d:] = others(x[d:])
    return y
