"""Native CPU kernels (C, AVX-512), built on first use, beside their plain-PyTorch references.

A decode step at batch 1 is a few MFLOP per layer: PyTorch's per-op cost (dispatch,
temporaries, dtype conversions; RMSNorm alone is 10 ops) is most of it. These kernels do the
same math in one call each, with the same rounding points (every `x` has an `x_ref`):

- `int4_mm`: the int4 weight-only matmul for a few rows, on the packed layout of PyTorch's int4
  CPU kernel (`cpu_int4.c`: AVX-512 BF16 dot products instead of an fp32 dequantization);
  for a prompt's rows, on CPUs with AMX, `int4_mm(tiles=True)` and `int4_gemm` (tile matmuls
  straight from the packed weights), and elsewhere `int4_dequant_t` before PyTorch's matmul;
- `rms_norm` (optionally adding into the residual stream first), `silu_mul`, `rope_`,
  `kv_store`, `decode_attention` (paged, online softmax) and `top_k` (`cpu_ops.c`);
- `DecoderStack.run`: every layer of a decode step in one call, through the functions above in
  the same order (`cpu_layers.c`), so that its results equal the per-op path's bit for bit.

The library is compiled with the system C compiler into the user cache directory, once per
source version, compiler and CPU; without a compiler, without AVX-512 BF16 and VBMI, or with
`LOCALLLM_NATIVE=0`, `available()` is False and callers keep PyTorch's kernels.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger("localllm")
SOURCES = tuple(Path(__file__).with_name(n) for n in (
    "cpu_int4.c", "cpu_int4_avx512.c", "cpu_int4_amx.c", "cpu_int4_dequant.c", "cpu_ops.c",
    "cpu_layers.c"))
HEADERS = tuple(Path(__file__).with_name(n) for n in ("cpu_kernels.h", "cpu_int4.h", "cpu_simd.h"))
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vbmi", "avx512_bf16")
AMX_FLAGS = ("amx_tile", "amx_bf16")
# AMX is opt-in (LOCALLLM_AMX=1): it makes batched decode 1.5x faster, but a row's result
# then differs (at fp32 rounding) between running alone and in a batch (see `amx_enabled`)
AMX_DEFAULT = os.environ.get("LOCALLLM_AMX", "0") == "1"
# -fopenmp: the library needs libgomp.so.1, which resolves to the one PyTorch already loaded,
# so both share one OpenMP thread team (two teams on two cores slow each other down 10x)
CFLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off", "-mavx512f",
          "-mavx512bw", "-mavx512vl", "-mavx512vbmi", "-mavx512bf16", "-mfma", "-mamx-tile",
          "-mamx-bf16",
          *os.environ.get("LOCALLLM_NATIVE_CFLAGS", "").split())
TILE, GROUP = 64, 32
GROUP_SIZES = (32, 16)  # the kernels' groups of columns; the scales' shape tells which


@cache
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _cpu_has(flags: tuple[str, ...]) -> bool:
    return all(f in _cpu_flags() for f in flags)


def _cpu_supports() -> bool:
    return _cpu_has(CPU_FLAGS)


def unavailable_reason() -> str | None:
    """Why the native kernels cannot run here without trying to build them, or None."""
    if os.environ.get("LOCALLLM_NATIVE", "1") == "0":
        return "LOCALLLM_NATIVE=0"
    if not _cpu_supports():
        return "the CPU lacks " + ", ".join(f for f in CPU_FLAGS if f not in _cpu_flags())
    if _compiler() is None:
        return "no C compiler (cc)"
    return None


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cache_dir() -> Path:
    import platformdirs

    return Path(os.environ.get("LOCALLLM_NATIVE_DIR")
                or Path(platformdirs.user_cache_dir("localllm")) / "native")


def _build(cc: str) -> Path:
    src = b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                             check=True).stdout.splitlines()[0]
    key = hashlib.sha256(src + version.encode() + " ".join(CFLAGS).encode()).hexdigest()[:16]
    out_dir = _cache_dir()
    lib = out_dir / f"localllm_cpu-{key}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    # several processes may build at once: each writes its own file, then renames it
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        subprocess.run([cc, *CFLAGS, "-o", tmp, *map(str, SOURCES), "-lm"], capture_output=True,
                       text=True, check=True)
        os.replace(tmp, lib)
        for old in out_dir.glob("localllm_cpu-*.so"):  # earlier versions (mapped ones stay valid)
            if old != lib:
                old.unlink(missing_ok=True)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


@cache
def _library() -> ctypes.CDLL | None:
    why = unavailable_reason()
    if why is not None:
        log.info("native CPU kernels off (%s): PyTorch ops instead", why)
        return None
    cc = _compiler()
    assert cc is not None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except subprocess.CalledProcessError as e:
        first = (e.stderr or "").strip().splitlines()[:1]
        log.warning("native CPU kernels did not compile (%s): PyTorch ops instead (slower)",
                    first[0] if first else f"{cc} exited with {e.returncode}")
        return None
    except OSError as e:
        log.warning("native CPU kernels could not be built or loaded (%s): PyTorch ops "
                    "instead (slower)", e)
        return None
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    signatures = {
        "int4_mm": ([ptr, i64, i64, i64, ptr, ptr, i64, i64, i64, ptr, i64, i64, ptr, i64],
                    ctypes.c_int),
        "int4_dequant_t": ([ptr, ptr, i64, i64, i64, ptr, i64, ptr, i64], None),
        "int4_amx_enable": ([ctypes.c_int], ctypes.c_int),
        "int4_gemm": ([ptr, i64, i64, i64, ptr, ptr, i64, i64, i64, ptr, i64, i64, ptr, i64,
                       i64], ctypes.c_int),
        "int4_gemm_ready": ([], ctypes.c_int),
        "int4_mm_tiles": ([ptr, i64, i64, i64, ptr, ptr, i64, i64, i64, ptr, i64, i64, ptr,
                           i64], ctypes.c_int),
        "rms_norm": ([ptr, i64, ptr, i64, ptr, i64, i64, f32, ptr, i64], None),
        "silu_mul": ([ptr, i64, i64, i64, ptr, i64], None),
        "rope": ([ptr, i64, i64, i64, i64, i64, ptr, ptr, i64, ptr, ctypes.c_int], ctypes.c_int),
        "kv_store": ([ptr, i64, ptr, i64, ptr, i64, i64, ptr, ptr, i64], ctypes.c_int),
        "decode_attention": ([ptr, i64, ptr, ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, i64,
                              f32, ptr, i64], ctypes.c_int),
        "top_k": ([ptr, i64, i64, i64, i64, ptr], None),
        "decode_layers": ([ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr,
                           i64], ctypes.c_int),
    }
    for name, (args, res) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    lib.int4_amx_enable(int(AMX_DEFAULT and _cpu_has(AMX_FLAGS)))
    return lib


def amx_enabled() -> bool:
    """Whether `int4_mm` runs batches of 2 rows and more on AMX tiles (LOCALLLM_AMX=1; needs
    amx_tile, amx_bf16 and the kernel's permission). They are 2-3x faster than AVX-512 at 8
    rows, but slower at 1 row in a real decode step (10.4 vs 6.0 ms: switching between AMX
    and the step's other code costs more than the tiles save), so one row stays on AVX-512.
    A row then gets the same result in any batch of 2 or more, but only the same to fp32
    rounding alone: greedy bf16 text of the default model diverged batched vs alone in 2 of
    8 sequences (0 of 8 without AMX). Off by default, so that a request's output never
    depends on what else runs."""
    lib = _library()
    return lib is not None and bool(lib.int4_amx_enable(-1))


def set_amx(on: bool) -> bool:
    """Turn the AMX path on or off for this process (tests and A/B runs); returns the state."""
    lib = _library()
    assert lib is not None
    return bool(lib.int4_amx_enable(int(on and _cpu_has(AMX_FLAGS))))


def available() -> bool:
    """Whether the native kernels run on this machine (built and loaded on first call)."""
    return _library() is not None


_gemm_on = os.environ.get("LOCALLLM_PREFILL_GEMM", "1") != "0"


def gemm_available() -> bool:
    """Whether `int4_gemm` runs prompts here: the native kernels, and AMX tiles (amx_tile,
    amx_bf16) that the OS lets this process use. Unlike `amx_enabled` (decode batches), this
    is on by default: a prompt's rows never ran the decode kernel anyway (they were a dense
    bf16 matmul), and a row's sums do not depend on its batch. LOCALLLM_PREFILL_GEMM=0 turns
    it off."""
    lib = _library()
    return (_gemm_on and lib is not None and _cpu_has(AMX_FLAGS)
            and bool(lib.int4_gemm_ready()))


def set_gemm(on: bool) -> bool:
    """Turn `int4_gemm` on or off for this process (tests and A/B runs); returns the state."""
    global _gemm_on
    _gemm_on = on
    return gemm_available()


def codebook_lut(codebook: torch.Tensor) -> torch.Tensor:
    """The kernels' form of a 16-entry codebook: bf16 [32], its bf16 rounding hi and the
    remainder lo = bf16(v - hi) (zero for integer codebooks such as IQ4_NL's), so that
    hi + lo holds values such as NF4's to about 2^-17. The kernels take one product per weight
    when lo is zero, two (hi and lo) otherwise."""
    v = codebook.float().reshape(16)
    hi = v.bfloat16()
    return torch.cat((hi, (v - hi.float()).bfloat16())).contiguous()


def lut_values(lut: torch.Tensor) -> torch.Tensor:
    """fp32 [16] codebook values hi + lo of a `codebook_lut`."""
    return lut[:16].float() + lut[16:].float()


def _lut_ptr(lut: torch.Tensor | None) -> int | None:
    if lut is None:
        return None
    if lut.shape != (32,) or lut.dtype != torch.bfloat16 or not lut.is_contiguous():
        raise ValueError("a codebook must be bf16 [32] (codebook_lut), contiguous")
    return lut.data_ptr()


def int4_mm(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor,
            out_features: int, planes: int, lut: torch.Tensor | None = None,
            tiles: bool = False) -> torch.Tensor:
    """x @ W.T for a packed int4 weight (`CpuPackedWeight` layout); call `available()` first.
    `tiles`: a prompt's rows, on AMX tiles where `gemm_available()` (groups of 32 without a
    codebook), whatever `amx_enabled` says.

    x: bf16 [M, in] with unit stride along `in`; packed: uint8 [out_padded, planes * in / 2];
    scales_zeros: bf16 [planes * in / gs, out_padded, 2] for groups of gs = 32 or 16 columns,
    or fp16 [in / gs, out_padded], the scales alone of a symmetric weight (`scales_layout`);
    lut: None, or the `codebook_lut` of a codebook weight (weights v[c] s + z instead of
    (c - 8) s + z) -> bf16 [M, out_features]."""
    lib = _library()
    assert lib is not None, "native kernels are not available"
    m, k, n_pad, layout = _matmul_operands("int4_mm", x, packed, scales_zeros, out_features,
                                           planes)
    y = torch.empty(m, out_features, dtype=torch.bfloat16)
    fn = lib.int4_mm_tiles if tiles and gemm_available() else lib.int4_mm
    if m and fn(x.data_ptr(), m, k, x.stride(0), packed.data_ptr(), scales_zeros.data_ptr(),
                out_features, n_pad, planes, y.data_ptr(), out_features, layout[0],
                _lut_ptr(lut), int(layout[1])):
        raise MemoryError("int4_mm: out of memory")
    return y


def _matmul_operands(name: str, x: torch.Tensor, packed: torch.Tensor,
                     scales_zeros: torch.Tensor, out_features: int, planes: int,
                     gated: bool = False) -> tuple[int, int, int, tuple[int, bool]]:
    """(rows, in, out_padded, scales_layout) of a packed matmul's operands, or a ValueError."""
    m, k = x.shape
    n_pad = packed.shape[0]
    layout = scales_layout(scales_zeros, planes * k, planes, n_pad)
    if (x.dtype != torch.bfloat16 or x.stride(1) != 1 or packed.dtype != torch.uint8
            or not packed.is_contiguous() or packed.shape[1] * 2 != planes * k or k % 32
            or n_pad % TILE or layout is None or not 0 < out_features <= n_pad
            or (gated and out_features % (2 * TILE))):
        raise ValueError(f"{name}: bad operands x {tuple(x.shape)} {x.dtype}, packed "
                         f"{tuple(packed.shape)}, scales {tuple(scales_zeros.shape)} "
                         f"{scales_zeros.dtype}, planes {planes}, out {out_features}")
    return m, k, n_pad, layout


def int4_gemm(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor,
              out_features: int, planes: int, lut: torch.Tensor | None = None,
              gated: bool = False) -> torch.Tensor:
    """x @ W.T over many rows on AMX tiles (check `gemm_available()`), with W's bf16 weights
    those of `int4_dequant_t`; operands as for `int4_mm`. `gated`: W stacks gate and up
    (out_features = 2 I, I a multiple of 64) and the result is silu(x Wg^T) * (x Wu^T),
    bf16 [M, I]; else bf16 [M, out_features]."""
    lib = _library()
    assert lib is not None and gemm_available(), "int4_gemm needs the native kernels and AMX"
    m, k, n_pad, layout = _matmul_operands("int4_gemm", x, packed, scales_zeros,
                                           out_features, planes, gated)
    n = out_features // 2 if gated else out_features
    y = torch.empty(m, n, dtype=torch.bfloat16)
    if m and lib.int4_gemm(x.data_ptr(), m, k, x.stride(0), packed.data_ptr(),
                           scales_zeros.data_ptr(), out_features, n_pad, planes, y.data_ptr(),
                           n, layout[0], _lut_ptr(lut), int(layout[1]), int(gated)):
        raise MemoryError("int4_gemm: out of memory")
    return y


def int4_gemm_ref(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor,
                  out_features: int, planes: int, lut: torch.Tensor | None = None,
                  gated: bool = False) -> torch.Tensor:
    """Plain-PyTorch reference of `int4_gemm`: bf16 weights, fp32 sums, bf16 products."""
    wt = int4_dequant_t_ref(packed, scales_zeros, planes, lut)[:, :out_features]
    y = (x.float() @ wt.float()).to(torch.bfloat16)
    return silu_mul_ref(y) if gated else y


def scales_layout(scales: torch.Tensor, k2: int, planes: int, n_pad: int
                  ) -> tuple[int, bool] | None:
    """(group size, half) of a packed weight's scales, or None when they fit neither form:
    bf16 (scale, zero) pairs [K2 / gs, n_pad, 2] (half False), or the fp16 scales alone of a
    symmetric weight, [K2 / planes / gs, n_pad] (half True: zeros implied, see cpu_int4.c)."""
    half = scales.dtype == torch.float16
    if not scales.is_contiguous() or scales.dim() != (2 if half else 3) or (
            not half and (scales.dtype != torch.bfloat16 or scales.shape[2] != 2)):
        return None
    groups, k = scales.shape[0], k2 // planes if half else k2
    gs = k // groups if groups and k % groups == 0 else 0
    if gs not in GROUP_SIZES or scales.shape[1] != n_pad:
        return None
    return gs, half


def int4_dequant_t(packed: torch.Tensor, scales_zeros: torch.Tensor, planes: int,
                   lut: torch.Tensor | None = None) -> torch.Tensor:
    """W.T of a packed int4 weight in bf16, [in, out_padded] (padded rows are 0): for one dense
    matmul over many rows. Planes are summed in fp32 and rounded once."""
    lib = _library()
    assert lib is not None
    n_pad, k2 = packed.shape[0], packed.shape[1] * 2
    layout = scales_layout(scales_zeros, k2, planes, n_pad) if planes in (1, 2) else None
    if not (packed.dtype == torch.uint8 and packed.is_contiguous() and n_pad % TILE == 0
            and layout is not None and k2 % (planes * 32) == 0):
        raise ValueError("int4_dequant_t: bad operands")
    k = k2 // planes
    wt = torch.empty(k, n_pad, dtype=torch.bfloat16)
    lib.int4_dequant_t(packed.data_ptr(), scales_zeros.data_ptr(), k, n_pad, planes,
                       wt.data_ptr(), layout[0], _lut_ptr(lut), int(layout[1]))
    return wt


def int4_dequant_t_ref(packed: torch.Tensor, scales_zeros: torch.Tensor, planes: int,
                       lut: torch.Tensor | None = None) -> torch.Tensor:
    k2 = packed.shape[1] * 2
    w = _dequant_fp32(packed, scales_zeros, planes, lut)  # [n_pad, K2]
    k = k2 // planes
    return w.view(-1, planes, k).sum(dim=1).t().to(torch.bfloat16)  # planes summed in fp32


def group_scales_zeros(scales_zeros: torch.Tensor, planes: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (scale, zero) [K2 / gs, n_pad] each of either scales form (`scales_layout`)."""
    if scales_zeros.dtype != torch.float16:
        sz = scales_zeros.float()
        return sz[..., 0], sz[..., 1]
    s = scales_zeros.float()  # [K / gs, n_pad]
    if planes == 1:
        return s, torch.zeros_like(s)
    return torch.cat((16.0 * s, s)), torch.cat((torch.zeros_like(s), 8.0 * s))


def _dequant_fp32(packed: torch.Tensor, scales_zeros: torch.Tensor, planes: int,
                  lut: torch.Tensor | None = None) -> torch.Tensor:
    """[n_pad, K2] fp32 weights of the packed layout, planes side by side."""
    n_pad, k2 = packed.shape[0], packed.shape[1] * 2
    b = packed.view(n_pad // TILE, k2, TILE // 2)
    codes = torch.stack((b & 15, b >> 4), dim=2)  # [tiles, K2, 2, 32]: rows 64t + 32h + j
    codes = codes.permute(0, 2, 3, 1).reshape(n_pad, k2).float()
    scale, zero = group_scales_zeros(scales_zeros, planes)  # [K2 / gs, n_pad]
    gs = k2 // scale.shape[0]
    values = codes - 8.0 if lut is None else lut_values(lut)[codes.long()]
    return (values * scale.t().repeat_interleave(gs, dim=1)
            + zero.t().repeat_interleave(gs, dim=1))


def int4_mm_ref(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor,
                out_features: int, planes: int, lut: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-PyTorch reference of `int4_mm`: dequantize to fp32, multiply, round to bf16."""
    w = _dequant_fp32(packed, scales_zeros, planes, lut)
    xin = x.float() if planes == 1 else torch.cat([x.float()] * planes, dim=1)
    return (xin @ w.t())[:, :out_features].to(torch.bfloat16)


def _rows(t: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> bool:
    """A 2-D tensor of `dtype` whose rows are contiguous (any row stride)."""
    return t.dim() == 2 and t.dtype == dtype and t.stride(1) == 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 [T, D] -> RMSNorm(x) * weight; with `residual` ([T, D], contiguous rows), first
    `residual += x` in place (rounded to bf16) and normalizes the sum instead."""
    lib = _library()
    assert lib is not None
    t, d = x.shape
    if not (_rows(x) and weight.is_contiguous() and weight.shape == (d,)
            and weight.dtype == torch.bfloat16
            and (residual is None or (_rows(residual) and residual.shape == x.shape))):
        raise ValueError("rms_norm: expects bf16 [T, D] rows and a bf16 [D] weight")
    out = torch.empty(t, d, dtype=torch.bfloat16)
    lib.rms_norm(x.data_ptr(), x.stride(0),
                 None if residual is None else residual.data_ptr(),
                 0 if residual is None else residual.stride(0),
                 weight.data_ptr(), t, d, eps, out.data_ptr(), d)
    return out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    if residual is not None:
        residual.copy_(x + residual)
        x = residual
    return F.rms_norm(x, (x.shape[-1],), weight, eps=eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """bf16 [T, 2 I] (gate | up) -> silu(gate) * up, [T, I]."""
    lib = _library()
    assert lib is not None
    t, n = gate_up.shape
    if not _rows(gate_up) or n % 2:
        raise ValueError("silu_mul: expects bf16 [T, 2 * I] rows")
    out = torch.empty(t, n // 2, dtype=torch.bfloat16)
    lib.silu_mul(gate_up.data_ptr(), gate_up.stride(0), t, n // 2, out.data_ptr(), n // 2)
    return out


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_(x: torch.Tensor, heads: int, head_dim: int, rot_dim: int, cos: torch.Tensor,
          sin: torch.Tensor, positions: torch.Tensor, neox: bool) -> torch.Tensor:
    """Rotates the first `heads` heads of each row of x (bf16 [T, >= heads * head_dim]) in
    place and returns x. cos, sin: fp32 [>= max position + 1, rot_dim / 2]; positions: [T]."""
    lib = _library()
    assert lib is not None
    t = x.shape[0]
    if not (_rows(x) and x.shape[1] >= heads * head_dim and rot_dim % 2 == 0
            and rot_dim <= head_dim and cos.dtype == sin.dtype == torch.float32
            and cos.is_contiguous() and sin.is_contiguous()
            and cos.shape == sin.shape and cos.shape[1] == rot_dim // 2
            and positions.dtype == torch.int64 and positions.is_contiguous()
            and positions.shape == (t,)):
        raise ValueError("rope_: bad operands")
    if lib.rope(x.data_ptr(), t, x.stride(0), heads, head_dim, rot_dim, cos.data_ptr(),
                sin.data_ptr(), cos.shape[0], positions.data_ptr(), int(neox)):
        raise ValueError("rope_: a position is outside the cos/sin tables")
    return x


def rope_ref(x: torch.Tensor, heads: int, head_dim: int, rot_dim: int, cos: torch.Tensor,
             sin: torch.Tensor, positions: torch.Tensor, neox: bool) -> torch.Tensor:
    t = x.shape[0]
    h = x[:, :heads * head_dim].view(t, heads, head_dim)
    r = h[..., :rot_dim].float()
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [T, 1, rot_dim / 2]
    if neox:
        x1, x2 = r[..., :rot_dim // 2], r[..., rot_dim // 2:]
        rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    else:
        x1, x2 = r[..., 0::2], r[..., 1::2]
        rotated = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    h[..., :rot_dim] = rotated.to(x.dtype)
    return x


def kv_store(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_pool: torch.Tensor,
             v_pool: torch.Tensor) -> None:
    """Writes rows k[t], v[t] (bf16 [T, n_kv * hd]) to pool slot slots[t]; pools are bf16
    [num_blocks, block_size, n_kv, hd], contiguous."""
    lib = _library()
    assert lib is not None
    t, row = k.shape
    n_slots = k_pool.numel() // max(row, 1)
    if not (_rows(k) and _rows(v) and v.shape == k.shape and k_pool.is_contiguous()
            and v_pool.is_contiguous() and k_pool.dtype == v_pool.dtype == torch.bfloat16
            and k_pool.shape == v_pool.shape and k_pool.shape[2] * k_pool.shape[3] == row
            and slots.dtype == torch.int64 and slots.is_contiguous() and slots.shape == (t,)):
        raise ValueError("kv_store: bad operands")
    if lib.kv_store(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slots.data_ptr(), t,
                    row, k_pool.data_ptr(), v_pool.data_ptr(), n_slots):
        raise ValueError("kv_store: a slot is outside the pool")


def kv_store_ref(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_pool: torch.Tensor,
                 v_pool: torch.Tensor) -> None:
    k_pool.view(-1, k.shape[1]).index_copy_(0, slots, k)
    v_pool.view(-1, v.shape[1]).index_copy_(0, slots, v)


MAX_GROUP, MAX_HEAD_DIM = 16, 256


def decode_attention_supported(n_heads: int, n_kv: int, head_dim: int) -> bool:
    return (head_dim % 16 == 0 and head_dim <= MAX_HEAD_DIM and n_heads % n_kv == 0
            and n_heads // n_kv <= MAX_GROUP)


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One query token per sequence over its cached K/V: q bf16 [B, n_heads, hd] (rows may be
    strided); pools bf16 [num_blocks, block_size, n_kv, hd]; block_tables int64 [B, width];
    context_lens int64 [B] (>= 1) -> bf16 [B, n_heads, hd]."""
    lib = _library()
    assert lib is not None
    b, n_heads, hd = q.shape
    _, bs, n_kv, hd2 = k_pool.shape
    width = block_tables.shape[1] if block_tables.dim() == 2 else 0
    if not (q.dtype == torch.bfloat16 and q.stride(2) == 1 and q.stride(1) == hd
            and hd2 == hd and decode_attention_supported(n_heads, n_kv, hd)
            and k_pool.is_contiguous() and v_pool.is_contiguous()
            and k_pool.shape == v_pool.shape and k_pool.dtype == v_pool.dtype == torch.bfloat16
            and block_tables.dtype == context_lens.dtype == torch.int64
            and block_tables.is_contiguous() and context_lens.is_contiguous()
            and block_tables.shape[0] == b and context_lens.shape == (b,)):
        raise ValueError("decode_attention: bad operands")
    out = torch.empty(b, n_heads, hd, dtype=torch.bfloat16)
    if lib.decode_attention(q.data_ptr(), q.stride(0), k_pool.data_ptr(), v_pool.data_ptr(),
                            k_pool.shape[0], block_tables.data_ptr(), width,
                            context_lens.data_ptr(), b, n_heads, n_kv, hd, bs, scale,
                            out.data_ptr(), n_heads * hd):
        raise ValueError("decode_attention: a context length or block is out of range")
    return out


def decode_attention_ref(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor,
                         scale: float) -> torch.Tensor:
    b, n_heads, hd = q.shape
    _, bs, n_kv, _ = k_pool.shape
    out = torch.empty(b, n_heads, hd, dtype=q.dtype)
    for i in range(b):
        ctx = int(context_lens[i])
        blocks = block_tables[i, :(ctx + bs - 1) // bs]
        k = k_pool[blocks].reshape(-1, n_kv, hd)[:ctx].float()  # [ctx, n_kv, hd]
        v = v_pool[blocks].reshape(-1, n_kv, hd)[:ctx].float()
        qh = q[i].float().view(n_kv, n_heads // n_kv, hd)  # [n_kv, group, hd]
        p = torch.softmax(torch.einsum("kgd,ckd->kgc", qh, k) * scale, dim=-1)
        out[i] = torch.einsum("kgc,ckd->kgd", p, v).reshape(n_heads, hd).to(q.dtype)
    return out


def top_k(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest of each row of x (fp32 [rows, n], k <= 64), largest first,
    ties to the lower index: int64 [rows, k]."""
    lib = _library()
    assert lib is not None
    rows, n = x.shape
    if not (_rows(x, torch.float32) and 0 < k <= min(n, 64)):
        raise ValueError("top_k: expects fp32 [rows, n] rows and 0 < k <= min(n, 64)")
    idx = torch.empty(rows, k, dtype=torch.int64)
    lib.top_k(x.data_ptr(), x.stride(0), rows, n, k, idx.data_ptr())
    return idx


def top_k_ref(x: torch.Tensor, k: int) -> torch.Tensor:
    # a stable sort puts equal values in index order
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]


class _PackedWeight(ctypes.Structure):
    _fields_ = [("packed", ctypes.c_void_p), ("sz", ctypes.c_void_p),
                ("out_features", ctypes.c_int64), ("out_padded", ctypes.c_int64),
                ("planes", ctypes.c_int64), ("group_size", ctypes.c_int64),
                ("lut", ctypes.c_void_p), ("half_scales", ctypes.c_int64)]


class _DecoderLayer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("qkv", _PackedWeight), ("o", _PackedWeight), ("gate_up", _PackedWeight),
                ("down", _PackedWeight), ("k_pool", ctypes.c_void_p),
                ("v_pool", ctypes.c_void_p)]


class _DecoderDims(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in (
        "hidden", "n_heads", "n_kv", "head_dim", "rot_dim", "neox", "intermediate",
        "block_size", "n_blocks")] + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]


@dataclass(frozen=True)
class PackedLinear:
    """One packed int4 weight as `int4_mm` takes it."""
    packed: torch.Tensor  # uint8 [out_padded, planes * in / 2]
    # bf16 [planes * in / gs, out_padded, 2], or fp16 [in / gs, out_padded] (`scales_layout`)
    scales_zeros: torch.Tensor
    in_features: int
    out_features: int
    planes: int
    group_size: int = GROUP
    lut: torch.Tensor | None = None  # bf16 [32]: a codebook weight's `codebook_lut`

    def check(self, name: str, in_features: int, out_features: int) -> None:
        n_pad = self.packed.shape[0]
        if not (self.in_features == in_features and self.out_features == out_features
                and self.packed.dtype == torch.uint8 and self.packed.is_contiguous()
                and n_pad % TILE == 0 and out_features <= n_pad and in_features % 32 == 0
                and self.packed.shape[1] * 2 == self.planes * in_features
                and scales_layout(self.scales_zeros, self.planes * in_features, self.planes,
                                  n_pad) == (self.group_size, self.half_scales)):
            raise ValueError(f"DecoderStack: {name} is not a packed [{out_features}, "
                             f"{in_features}] weight")

    def struct(self) -> _PackedWeight:
        return _PackedWeight(self.packed.data_ptr(), self.scales_zeros.data_ptr(),
                             self.out_features, self.packed.shape[0], self.planes,
                             self.group_size, _lut_ptr(self.lut), int(self.half_scales))

    @property
    def half_scales(self) -> bool:
        return self.scales_zeros.dtype == torch.float16


@dataclass(frozen=True)
class StackLayer:
    input_norm: torch.Tensor  # bf16 [hidden]
    post_norm: torch.Tensor  # bf16 [hidden]
    qkv: PackedLinear  # [(n_heads + 2 n_kv) head_dim, hidden]: q | k | v
    o: PackedLinear  # [hidden, n_heads head_dim]
    gate_up: PackedLinear  # [2 intermediate, hidden]: gate | up
    down: PackedLinear  # [hidden, intermediate]


@dataclass(frozen=True)
class StackDims:
    hidden: int
    n_heads: int
    n_kv: int
    head_dim: int
    rot_dim: int
    neox: bool
    intermediate: int
    eps: float
    scale: float


class DecoderStack:
    """The decoder layers of a model, described once for `decode_layers` (which runs them all
    for a decode step in one call). Holds references to every tensor it points at."""

    def __init__(self, layers: list[StackLayer], final_norm: torch.Tensor,
                 dims: StackDims, max_rows: int) -> None:
        # max_rows: the most sequences one call takes
        self.max_rows = max_rows
        d = dims
        if not layers or d.n_heads % d.n_kv or not decode_attention_supported(
                d.n_heads, d.n_kv, d.head_dim) or d.rot_dim % 2 or d.rot_dim > d.head_dim:
            raise ValueError("DecoderStack: unsupported dimensions")
        for i, layer in enumerate(layers):
            for norm in (layer.input_norm, layer.post_norm):
                if norm.dtype != torch.bfloat16 or norm.shape != (d.hidden,) \
                        or not norm.is_contiguous():
                    raise ValueError(f"DecoderStack: layer {i}: bad norm weight")
            layer.qkv.check(f"layer {i} qkv", d.hidden, (d.n_heads + 2 * d.n_kv) * d.head_dim)
            layer.o.check(f"layer {i} o", d.n_heads * d.head_dim, d.hidden)
            layer.gate_up.check(f"layer {i} gate_up", d.hidden, 2 * d.intermediate)
            layer.down.check(f"layer {i} down", d.intermediate, d.hidden)
        if final_norm.dtype != torch.bfloat16 or final_norm.shape != (d.hidden,) \
                or not final_norm.is_contiguous():
            raise ValueError("DecoderStack: bad final norm weight")
        self.layers, self.final_norm, self.dims = layers, final_norm, dims
        self._structs = (_DecoderLayer * len(layers))(*[
            _DecoderLayer(l.input_norm.data_ptr(), l.post_norm.data_ptr(), l.qkv.struct(),
                          l.o.struct(), l.gate_up.struct(), l.down.struct(), None, None)
            for l in layers])
        self._pools: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._pool_key: tuple[int, ...] = ()
        self._dims = _DecoderDims(d.hidden, d.n_heads, d.n_kv, d.head_dim, d.rot_dim,
                                  int(d.neox), d.intermediate, 0, 0, d.eps, d.scale)

    def _set_pools(self, pools: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        key = tuple(t.data_ptr() for kv in pools for t in kv)
        if key == self._pool_key:
            return
        d = self.dims
        if len(pools) != len(self.layers):
            raise ValueError("DecoderStack: one K/V pool pair per layer expected")
        shape = pools[0][0].shape
        for k, v in pools:
            if not (k.shape == v.shape == shape and len(shape) == 4
                    and shape[2:] == (d.n_kv, d.head_dim) and k.dtype == v.dtype == torch.bfloat16
                    and k.is_contiguous() and v.is_contiguous()):
                raise ValueError("DecoderStack: bad K/V pools")
        for s, (k, v) in zip(self._structs, pools):
            s.k_pool, s.v_pool = k.data_ptr(), v.data_ptr()
        self._dims.n_blocks, self._dims.block_size = shape[0], shape[1]
        self._pools, self._pool_key = pools, key

    def run(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            block_tables: torch.Tensor, context_lens: torch.Tensor,
            pools: list[tuple[torch.Tensor, torch.Tensor]], cos: torch.Tensor,
            sin: torch.Tensor) -> torch.Tensor:
        """x: bf16 [M, hidden] embeddings of M sequences' next tokens -> final normalized
        hidden states [M, hidden] (x itself, overwritten). positions, slots, context_lens:
        int64 [M]; block_tables: int64 [M, width]; cos, sin: fp32 [rows, rot_dim / 2]."""
        lib = _library()
        assert lib is not None
        self._set_pools(pools)
        m = x.shape[0]
        i64 = torch.int64
        if not (x.dtype == torch.bfloat16 and x.is_contiguous() and x.dim() == 2
                and x.shape[1] == self.dims.hidden and 0 < m <= self.max_rows
                and positions.dtype == slots.dtype == context_lens.dtype == i64
                and block_tables.dtype == i64 and block_tables.dim() == 2
                and block_tables.shape[0] == m and block_tables.is_contiguous()
                and positions.shape == slots.shape == context_lens.shape == (m,)
                and positions.is_contiguous() and slots.is_contiguous()
                and context_lens.is_contiguous()
                and cos.dtype == sin.dtype == torch.float32 and cos.shape == sin.shape
                and cos.is_contiguous() and sin.is_contiguous()
                and cos.shape[1] == self.dims.rot_dim // 2):
            raise ValueError("DecoderStack.run: bad operands")
        rc = lib.decode_layers(self._structs, len(self.layers), ctypes.byref(self._dims),
                               self.final_norm.data_ptr(), x.data_ptr(), m,
                               positions.data_ptr(), slots.data_ptr(), block_tables.data_ptr(),
                               block_tables.shape[1], context_lens.data_ptr(), cos.data_ptr(),
                               sin.data_ptr(), cos.shape[0])
        if rc == -2:
            raise MemoryError("decode_layers: out of memory")
        if rc:
            raise ValueError("decode_layers: a position, slot, block or context length is out "
                             "of range")
        return x

    def run_ref(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                block_tables: torch.Tensor, context_lens: torch.Tensor,
                pools: list[tuple[torch.Tensor, torch.Tensor]], cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        """Plain-PyTorch reference of `run` (returns a new tensor)."""
        d, m = self.dims, x.shape[0]
        nh, nkv, hd = d.n_heads, d.n_kv, d.head_dim

        def mm(w: PackedLinear, a: torch.Tensor) -> torch.Tensor:
            return int4_mm_ref(a, w.packed, w.scales_zeros, w.out_features, w.planes, w.lut)

        res = x.clone()
        y = x
        for i, (layer, (kp, vp)) in enumerate(zip(self.layers, pools)):
            h = (rms_norm_ref(res, layer.input_norm, d.eps) if i == 0
                 else rms_norm_ref(y, layer.input_norm, d.eps, res))
            qkv = rope_ref(mm(layer.qkv, h), nh + nkv, hd, d.rot_dim, cos, sin, positions,
                           d.neox)
            kv_store_ref(qkv[:, nh * hd:(nh + nkv) * hd], qkv[:, (nh + nkv) * hd:], slots,
                         kp, vp)
            att = decode_attention_ref(qkv[:, :nh * hd].reshape(m, nh, hd), kp, vp,
                                       block_tables, context_lens, d.scale)
            h = rms_norm_ref(mm(layer.o, att.reshape(m, nh * hd)), layer.post_norm, d.eps, res)
            y = mm(layer.down, silu_mul_ref(mm(layer.gate_up, h)))
        return rms_norm_ref(y, self.final_norm, d.eps, res)
