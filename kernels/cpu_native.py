"""Native CPU kernels (C, AVX-512): CPU-flag detection, the build, and the loaded library.

A decode step at batch 1 is a few MFLOP per layer: PyTorch's per-op cost (dispatch,
temporaries, dtype conversions; RMSNorm alone is 10 ops) is most of it. The C kernels do the
same math in one call each, with the same rounding points. Their Python wrappers sit beside
their plain-PyTorch references (every `x` has an `x_ref`, a test oracle), one module per
family:

- `cpu_int4`: the int4 weight-only matmul for a few rows (`int4_mm`, AVX-512 BF16 dot
  products on the packed layout of PyTorch's int4 CPU kernel); for a prompt's rows, on CPUs
  with AMX, `int4_mm(tiles=True)` and `int4_gemm` (tile matmuls straight from the packed
  weights), and elsewhere `int4_dequant_t` before PyTorch's matmul;
- `cpu_ops`: `rms_norm` (optionally adding into the residual stream first), `silu_mul`,
  `rope_`, `kv_store`, `decode_attention` (paged, online softmax) and `top_k`;
- `cpu_layers`: `DecoderStack.run`, every layer of a decode step in one call, through the
  functions above in the same order, so that its results equal the per-op path's bit for bit.

Only the CPU backend (`localllm/backends/cpu/`) imports these modules.

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
from functools import cache
from pathlib import Path

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


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, or None where the kernels do not run (see `available`)."""
    return _library()


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
