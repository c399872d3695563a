"""Native CPU kernels (C; AVX-512 or AVX2): CPU-flag detection, the builds, the loaded library.

A decode step at batch 1 is a few MFLOP per layer: PyTorch's per-op cost (dispatch,
temporaries, dtype conversions; RMSNorm alone is 10 ops) is most of it. The C kernels do the
same math in one call each, with the same rounding points. Their Python wrappers sit beside
their plain-PyTorch references (every `x` has an `x_ref`, a test oracle), one module per
family:

- `cpu_int4`: the int4 weight-only matmul for a few rows (`int4_mm`, on the packed layout of
  PyTorch's int4 CPU kernel: x rounded to 16 bits per group and exact integer products with
  the codes, by VNNI and, for batches on CPUs with AMX, AMX-INT8 tiles, or by vpmaddwd in the
  AVX2 build, the same bits in both builds; codebook weights take AVX-512 BF16 dot products,
  or fp32 FMAs in the AVX2 build); for a
  prompt's rows, on CPUs with AMX, `int4_mm(tiles=True)` and `int4_gemm` (tile matmuls
  straight from the packed weights), and elsewhere `int4_dequant_t` before PyTorch's matmul;
  `int4_rows_half`, whole rows of a weight with fp16 scales in fp32 (an LM head's
  refined logits, embedding lookups); `int8_logits`, a Q8_0 LM head's fp32 logits from x
  rounded to 16 bits per group (16-bit integer products: VNNI, or vpmaddwd in the AVX2 build,
  the same numbers); `int4_refine_half`, the best logits recomputed from the exact rows;
- `cpu_ops`: `rms_norm` (optionally adding into the residual stream first), `silu_mul`,
  `rope_`, `kv_store`, `decode_attention` (paged, online softmax), `top_k` and
  `sample_rows` (sampled tokens drawn as the engine's Sampler draws them);
- `cpu_layers`: `DecoderStack.run`, every layer of a decode step in one call, through the
  functions above in the same order, so that its results equal the per-op path's bit for bit.

Only the CPU backend (`localllm/backends/cpu/`) imports these modules.

There are two builds of the library, from the same packed layouts and references:
`avx512` (AVX-512 BF16, VBMI and VNNI, and AMX where the CPU has it: Intel Sapphire Rapids and
later, AMD Zen 4 and later) and `avx2` (AVX2, FMA and F16C: Intel Haswell and later, AMD Zen
1-3). The AVX2 build is also compiled as `avx2_vnni` for CPUs with AVX-VNNI (Intel Alder Lake
through Arrow Lake): its 16-bit integer products take one `vpdpwssd` where `avx2` takes
`vpmaddwd` and `vpaddd`, the same int32 sums, so the same bits. `isa()` picks the first of
ISAS the CPU runs; `LOCALLLM_NATIVE_ISA=avx2` (or `avx2_vnni`, `avx512`) asks for one, e.g.
to test or measure the AVX2 build on a bigger CPU. Each build is compiled with the system C
compiler into the user cache directory, once per build, source version, compiler and CPU;
without a compiler, without either set of CPU features, or with `LOCALLLM_NATIVE=0`,
`available()` is False and callers keep PyTorch's kernels.
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


def _files(*names: str) -> tuple[Path, ...]:
    return tuple(Path(__file__).with_name(n) for n in names)


ISAS = ("avx512", "avx2_vnni", "avx2")  # in the order `isa()` prefers them
SOURCES = {
    "avx512": _files("cpu_int4.c", "cpu_int4_avx512.c", "cpu_int4_vnni.c", "cpu_int4_amx_int8.c",
                     "cpu_int4_amx.c", "cpu_int4_dequant.c", "cpu_int4_rows.c", "cpu_int8_logits.c",
                     "cpu_ops.c", "cpu_sample.c", "cpu_layers.c"),
    "avx2": _files("cpu_int4_avx2.c", "cpu_int4_avx2_int.c", "cpu_int4_rows.c",
                   "cpu_int8_logits_avx2.c", "cpu_ops_avx2.c", "cpu_attn_avx2.c", "cpu_sample.c",
                   "cpu_layers.c"),
}
SOURCES["avx2_vnni"] = SOURCES["avx2"]  # with -mavxvnni: dot_pairs (cpu_simd_avx2.h)
HEADERS = {
    "avx512": _files("cpu_kernels.h", "cpu_int4.h", "cpu_int4_groups.h", "cpu_int4_tiles.h",
                     "cpu_int4_vnni.h", "cpu_int4_xint.h", "cpu_int8_rows.h", "cpu_paged.h",
                     "cpu_simd.h", "cpu_simd_avx2.h", "cpu_team.h"),
    "avx2": _files("cpu_kernels.h", "cpu_int4_avx2.h", "cpu_int4_groups.h", "cpu_int4_xint.h",
                   "cpu_int8_rows.h", "cpu_paged.h", "cpu_simd_avx2.h", "cpu_team.h"),
}
HEADERS["avx2_vnni"] = HEADERS["avx2"]
ISA_FLAGS = {
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512vbmi", "avx512_bf16", "avx512_vnni",
               "fma"),
    "avx2": ("avx2", "fma", "f16c"),
}
ISA_FLAGS["avx2_vnni"] = (*ISA_FLAGS["avx2"], "avx_vnni")
CPU_FLAGS = ISA_FLAGS["avx512"]
AMX_FLAGS = ("amx_tile", "amx_bf16")  # a prompt's rows on bf16 tiles
AMX_DECODE_FLAGS = ("amx_tile", "amx_int8")  # decoding rows' batches on AMX-INT8 tiles
# decoding rows on AMX tiles where the CPU has them (see `amx_mode`): LOCALLLM_AMX=1 or int8
# (the default) batches on AMX-INT8, =bf16 every row on bf16 tiles, =0 or off none (VNNI)
AMX_MODES = {"int8": (1, AMX_DECODE_FLAGS), "bf16": (2, AMX_FLAGS), "off": (0, ())}
_AMX_SETTINGS = {"1": "int8", "int8": "int8", "bf16": "bf16", "0": "off", "off": "off"}
_amx_setting = os.environ.get("LOCALLLM_AMX", "1").strip().lower()
if _amx_setting not in _AMX_SETTINGS:
    log.warning("LOCALLLM_AMX=%s is none of %s; using int8", _amx_setting,
                ", ".join(_AMX_SETTINGS))
AMX_DEFAULT = _AMX_SETTINGS.get(_amx_setting, "int8")
# -fopenmp: the library needs libgomp.so.1, which resolves to the one PyTorch already loaded,
# so both share one OpenMP thread team (two teams on two cores slow each other down 10x)
_COMMON = ("-O3", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off")
_EXTRA = tuple(os.environ.get("LOCALLLM_NATIVE_CFLAGS", "").split())
ISA_CFLAGS = {
    "avx512": (*_COMMON, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vbmi",
               "-mavx512bf16", "-mavx512vnni", "-mfma", "-mamx-tile", "-mamx-bf16", "-mamx-int8",
               *_EXTRA),
    "avx2": (*_COMMON, "-mavx2", "-mfma", "-mf16c", *_EXTRA),
    "avx2_vnni": (*_COMMON, "-mavx2", "-mfma", "-mf16c", "-mavxvnni", *_EXTRA),
}
CFLAGS = ISA_CFLAGS["avx512"]
_forced = os.environ.get("LOCALLLM_NATIVE_ISA", "").strip().lower() or None
_active: str | None = None  # set_isa's choice for this process; None: `_forced` or the best


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


def isa_supported(name: str) -> bool:
    """Whether this CPU has the features of build `name` (one of ISAS)."""
    return _cpu_has(ISA_FLAGS[name])


def isa() -> str | None:
    """The build this process runs: `set_isa`'s, else LOCALLLM_NATIVE_ISA's, else the first of
    ISAS the CPU supports; None when none does (or the forced one is unknown or unsupported:
    see `unavailable_reason`)."""
    want = _active or _forced
    if want is not None:
        return want if want in ISAS and isa_supported(want) else None
    return next((n for n in ISAS if isa_supported(n)), None)


def isas_available() -> tuple[str, ...]:
    """The builds that run on this machine (tests run each kernel under every one)."""
    if os.environ.get("LOCALLLM_NATIVE", "1") == "0":
        return ()
    return tuple(n for n in ISAS if isa_supported(n) and _library_of(n) is not None)


def set_isa(name: str | None) -> str | None:
    """Switch this process to build `name` (None: back to the default choice); the packed
    weights are the same for every build. Returns the build now in use."""
    global _active
    if name is not None and name not in ISAS:
        raise ValueError(f"unknown native build {name!r}: expected one of {', '.join(ISAS)}")
    _active = name
    return isa()


def unavailable_reason() -> str | None:
    """Why the native kernels cannot run here without trying to build them, or None."""
    if os.environ.get("LOCALLLM_NATIVE", "1") == "0":
        return "LOCALLLM_NATIVE=0"
    want = _active or _forced
    if want is not None and want not in ISAS:
        return f"LOCALLLM_NATIVE_ISA={want} is none of {', '.join(ISAS)}"
    if want is not None and not isa_supported(want):
        return (f"the CPU lacks {', '.join(f for f in ISA_FLAGS[want] if f not in _cpu_flags())}"
                f" for the {want} build")
    if isa() is None:
        return "the CPU lacks " + ", ".join(f for f in ISA_FLAGS["avx2"]
                                            if f not in _cpu_flags())
    if _compiler() is None:
        return "no C compiler (cc)"
    return None


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cache_dir() -> Path:
    import platformdirs

    return Path(os.environ.get("LOCALLLM_NATIVE_DIR")
                or Path(platformdirs.user_cache_dir("localllm")) / "native")


def _build(cc: str, name: str = "avx512") -> Path:
    """The library of build `name`, compiled unless the cache has it: its file name holds the
    build's name and a hash of sources, compiler and flags, so builds never replace each
    other."""
    src = b"".join(p.read_bytes() for p in SOURCES[name] + HEADERS[name])
    version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                             check=True).stdout.splitlines()[0]
    flags = ISA_CFLAGS[name]
    key = hashlib.sha256(src + version.encode() + " ".join(flags).encode()).hexdigest()[:16]
    out_dir = _cache_dir()
    lib = out_dir / f"localllm_cpu_{name}-{key}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    # several processes may build at once: each writes its own file, then renames it
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        subprocess.run([cc, *flags, "-o", tmp, *map(str, SOURCES[name]), "-lm"],
                       capture_output=True, text=True, check=True)
        os.replace(tmp, lib)
        # earlier versions of this build (mapped ones stay valid)
        for old in out_dir.glob(f"localllm_cpu_{name}-*.so"):
            if old != lib:
                old.unlink(missing_ok=True)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


_chosen: dict[str | None, ctypes.CDLL | None] = {}  # `set_isa`'s choice -> its library


def _library() -> ctypes.CDLL | None:
    # NOTE: asked before every kernel call: a dictionary hit after the first
    try:
        return _chosen[_active]
    except KeyError:
        pass
    why = unavailable_reason()
    if why is not None:
        log.info("native CPU kernels off (%s): PyTorch ops instead", why)
        lib = None
    else:
        name = isa()
        assert name is not None
        lib = _library_of(name)
    _chosen[_active] = lib
    return lib


@cache
def _library_of(name: str) -> ctypes.CDLL | None:
    cc = _compiler()
    if cc is None or not isa_supported(name):
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc, name)))
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
        "int4_rows_half": ([ptr, ptr, i64, i64, i64, i64, ptr, i64, ptr], None),
        "int4_refine_half": ([ptr, i64, i64, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64],
                             None),
        "int8_logits": ([ptr, i64, i64, i64, ptr, ptr, i64, i64, ptr, i64], ctypes.c_int),
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
                              f32, ptr, i64, ptr], ctypes.c_int),
        "top_k": ([ptr, i64, i64, i64, i64, ptr], None),
        "sample_rows": ([ptr, i64, i64, i64, ptr, i64, ptr], None),
        "decode_layers": ([ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr,
                           i64, ptr, ptr, i64], ctypes.c_int),
    }
    for fn_name, (args, res) in signatures.items():
        fn = getattr(lib, fn_name)
        fn.argtypes, fn.restype = args, res
    _amx_switch(lib, AMX_DEFAULT)
    return lib


def _amx_switch(lib: ctypes.CDLL, mode: str) -> str:
    code, flags = AMX_MODES[mode]
    got = lib.int4_amx_enable(code if _cpu_has(flags) else 0)
    return next(name for name, (c, _) in AMX_MODES.items() if c == got)


def amx_mode() -> str:
    """Which tiles run decoding rows: "int8" (the default where the CPU has amx_tile and
    amx_int8 and the kernel grants them), "bf16" (LOCALLLM_AMX=bf16) or "off" (LOCALLLM_AMX=0,
    or no AMX).

    "int8": batches of 2 to 8 decoding rows of a weight in groups of 32 (without a codebook)
    run on AMX-INT8 tiles, one row on VNNI. Both sum x's 16-bit integers times the codes
    exactly and take the same fp32 epilogue, so a row gets the same bits whichever runs it,
    alone or batched, and the same as on VNNI alone ("off") or in the AVX2 build.
    "bf16": every decoding row of such a weight, one row included, on bf16 tiles (the prompt
    path's products): other bits than the integer paths', but the same alone or batched. On
    the 2-core Xeon (family 6, model 207) one stream decoded 1.36x as fast on "int8" as on
    "bf16" and eight streams 0.85x (`benchmarks/README.md`)."""
    lib = _library()
    if lib is None:
        return "off"
    return next(name for name, (c, _) in AMX_MODES.items() if c == lib.int4_amx_enable(-1))


def amx_enabled() -> bool:
    """Whether decoding rows run on AMX tiles at all (`amx_mode` is not "off")."""
    return amx_mode() != "off"


def set_amx(on: bool | str) -> bool:
    """Set `amx_mode` for this process (tests and A/B runs): True is "int8", False "off", or
    a mode's name; a mode the CPU cannot run falls back to "off". Returns whether AMX is on."""
    lib = _library()
    assert lib is not None
    mode = on if isinstance(on, str) else "int8" if on else "off"
    return _amx_switch(lib, mode) != "off"


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, or None where the kernels do not run (see `available`)."""
    return _library()


def available() -> bool:
    """Whether the native kernels run on this machine (built and loaded on first call)."""
    return _library() is not None


_gemm_on = os.environ.get("LOCALLLM_PREFILL_GEMM", "1") != "0"


def gemm_available() -> bool:
    """Whether `int4_gemm` runs prompts here: the native kernels, and AMX tiles (amx_tile,
    amx_bf16) that the OS lets this process use: a prompt's rows take one path whatever shares
    their step (the one their prompt's length picks), and a row's sums do not depend on its
    batch.
    LOCALLLM_PREFILL_GEMM=0 turns it off."""
    lib = _library()
    return (_gemm_on and lib is not None and _cpu_has(AMX_FLAGS)
            and bool(lib.int4_gemm_ready()))


def set_gemm(on: bool) -> bool:
    """Turn `int4_gemm` on or off for this process (tests and A/B runs); returns the state."""
    global _gemm_on
    _gemm_on = on
    return gemm_available()
