"""Which matmul a packed weight's rows take: the CPU backend's one policy table.

A packed matmul's rows are decoding tokens or a prompt's tokens. Decoding rows always take the
few-rows kernel, which computes every row the same way whatever else shares its batch, so a
request's tokens do not depend on its neighbours, even when a long prompt shares the step.
Within an engine step (`step_rows`) a prompt's rows take the path its whole prompt's length
picks (`prompt_path`), one that computes each row alone: never the dequantized weight with
PyTorch's matmul, whose rows change with the call's row count. So a prompt's tokens are the
same whether it is prefilled in one step, split over steps by the token budget, beside other
prompts, or resumed after a cached prefix. Outside a step (`decode_rows`, or nothing) the
leading decoding rows take the kernel and the others the path their own count picks.

`ROW_POLICY[machine, kind]` lists (at most this many rows, path) in order. The machine is
`amx` (native kernels and AMX tiles), `native` (native kernels without AMX: the AVX-512 or
the AVX2 build) or `torch` (PyTorch's int4 kernel), or `any` for weights only PyTorch's int8
kernel takes. The
kind is, on the native machines, `codes` (groups of 32 without a codebook: AMX tiles read
their codes directly) or `other`; on `torch`, the planes (PyTorch's kernel runs them one at a
time, so two-plane weights leave it at half the rows); `int8 per channel` on `any`. The
few-rows kernel's tiles for decoding rows follow `cpu_native.amx_mode` (AMX-INT8 by default:
other bits than TILES' bf16 products; with LOCALLLM_AMX=bf16 the same as TILES). The figures
below were measured when the AVX-512 kernel multiplied in bf16 (before its integer path).
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
# without them (no AMX) a prompt's gate/up product is held GATED_BLOCK rows at a time (a 512-token
# chunk's whole [rows, 2 * intermediate] raised the default model's peak memory by 3 MiB)
GATED_BLOCK = 128

# how many leading rows of the batch in flight are decoding tokens (see the module docstring)
_DECODE_ROWS: ContextVar[int] = ContextVar("decode_rows", default=0)
# the step's rows as runs (rows, prompt length): 0 for decoding rows (`step_rows`)
_ROW_RUNS: ContextVar[tuple[tuple[int, int], ...] | None] = ContextVar("row_runs", default=None)
Rows = slice | torch.Tensor  # the rows of a batch one path takes


@contextmanager
def decode_rows(n: int) -> Iterator[None]:
    """Within this block, the first `n` rows of every packed matmul are decoding tokens: they
    take the few-rows kernel whatever the batch size."""
    token = _DECODE_ROWS.set(n)
    try:
        yield
    finally:
        _DECODE_ROWS.reset(token)


@contextmanager
def step_rows(runs: tuple[tuple[int, int], ...]) -> Iterator[None]:
    """Within this block the batch's rows are `runs`, in order: (rows, prompt length), with
    prompt length 0 for decoding rows (`AttentionMetadata.row_runs`)."""
    token = _ROW_RUNS.set(runs)
    try:
        yield
    finally:
        _ROW_RUNS.reset(token)


def step_planned() -> bool:
    """Whether a `step_rows` block is in force."""
    return _ROW_RUNS.get() is not None


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
    parts = [{"avx512": "AVX-512 BF16", "avx2_vnni": "AVX2 FMA + AVX-VNNI", "avx2": "AVX2 FMA"}
             .get(cpu_native.isa() or "", "?")]
    if cpu_native.gemm_available():
        parts.append("AMX prefill")
    if cpu_native.amx_enabled():
        parts.append({"int8": "AMX-INT8 decode"}.get(cpu_native.amx_mode(), "AMX bf16 decode"))
    return " + ".join(parts)


def packed_policy(codes: bool, planes: int, native: bool = True) -> Policy:
    """The row policy of a packed int4 weight of `planes` planes; `codes` as in the module
    docstring; `native` False for a weight the native kernels cannot read (PyTorch's)."""
    m = machine() if native else "torch"
    if m == "torch":
        return ROW_POLICY[m, "1 plane" if planes == 1 else "2 planes"]
    return ROW_POLICY[m, "codes" if codes else "other"]


def rest_path(table: Policy, rows: int) -> MatmulPath:
    """The path of `rows` non-decoding rows of a batch larger than the kernel's limit."""
    return next(path for limit, path in table[1:] if rows <= limit)


def decoding_split(table: Policy, rows: int) -> int:
    """How many of a batch's `rows` leading rows take the kernel (outside `step_rows`)."""
    if rows <= table[0][0]:
        return rows
    return min(_DECODE_ROWS.get(), rows)


def prompt_path(table: Policy, prompt_len: int) -> MatmulPath:
    """The path of every row of a prompt of `prompt_len` tokens (0: decoding rows) within a
    step: the first entry whose row count it fits, except that it never takes `D`, whose rows
    change with the call's row count (PyTorch's bf16 matmul splits its work by the shape),
    but the last other entry's path (on the `native` machine the kernel, whose 512-token
    prefill takes about 1.1x as long)."""
    entries = [(limit, path) for limit, path in table if path is not D]
    return next((path for limit, path in entries if prompt_len <= limit), entries[-1][1])


def row_groups(table: Policy, rows: int) -> list[tuple[MatmulPath, Rows]]:
    """The batch's `rows` by path, in order of their first row: within `step_rows` each run
    takes its prompt's path (runs of one path together), else the leading decoding rows take
    the kernel and the others the path their count picks."""
    runs = _ROW_RUNS.get()
    if runs is None or sum(n for n, _ in runs) != rows:
        d = decoding_split(table, rows)
        groups: list[tuple[MatmulPath, Rows]] = [(K, slice(0, d))] if d else []
        if d < rows:
            n = rows - d
            groups.append((K if n <= table[0][0] else rest_path(table, n), slice(d, rows)))
        return groups
    spans: dict[MatmulPath, list[tuple[int, int]]] = {}
    start = 0
    for n, prompt_len in runs:
        if n:
            spans.setdefault(prompt_path(table, prompt_len), []).append((start, start + n))
        start += n
    out: list[tuple[MatmulPath, Rows]] = []
    for path, ranges in spans.items():
        if all(a == b for (_, a), (b, _) in zip(ranges, ranges[1:])):  # one contiguous run
            out.append((path, slice(ranges[0][0], ranges[-1][1])))
        else:
            out.append((path, torch.cat([torch.arange(a, b) for a, b in ranges])))
    return out


def split_matmul(x: torch.Tensor, table: Policy,
                 kernel: Callable[[torch.Tensor], torch.Tensor],
                 rest: Callable[[torch.Tensor, MatmulPath], torch.Tensor],
                 out_features: int) -> torch.Tensor:
    """x @ W.T, each group of `row_groups` through its path: `kernel` (K), else
    `rest(rows, path)`."""
    def run(path: MatmulPath, rows: torch.Tensor) -> torch.Tensor:
        return kernel(rows) if path is K else rest(rows, path)

    groups = row_groups(table, x.shape[0])
    if len(groups) == 1:
        return run(groups[0][0], x)
    y = torch.empty(x.shape[0], out_features, dtype=x.dtype, device=x.device)
    for path, rows in groups:
        y[rows] = run(path, x[rows])
    return y
