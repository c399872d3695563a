"""Load a model and its tokenizer from a GGUF file."""

from __future__ import annotations

import hashlib
import logging
import math
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import torch

from localllm.backends import make_backend
from localllm.config import ModelConfig
from localllm.errors import ModelLoadError
from localllm.gguf.config import config_of_file
from localllm.gguf.reader import GGUFFile, TensorInfo
from localllm.gguf.tensors import module_name, qtype_name
from localllm.layers.backend import Backend
from localllm.layers.linear import Linear, replace_module, row_source
from localllm.memory import glibc, release_free_memory
from localllm.models.llama import LlamaForCausalLM
from localllm.models.registry import model_class
from localllm.quant.dequant import dequantize
from localllm.quant.formats import Int4Weight, Int8Weight
from localllm.quant.repack import DENSE_TYPES, repack
from localllm.text.tokenizer import Tokenizer

ProgressFn = Callable[[int, int], None]


class LoadedModel(NamedTuple):
    model: LlamaForCausalLM  # built with `backend`, which owns its packed weights
    tokenizer: Tokenizer
    config: ModelConfig
    path: Path
    fingerprint: str  # identifies the weights: file contents and size (not the dtype)
    backend: Backend


def file_fingerprint(path: Path) -> str:
    """A fast content fingerprint: size plus sha256 of the first and last 4 MiB."""
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(str(size).encode())
    span = 4 << 20
    with open(path, "rb") as f:
        # in 256 KiB pieces: two 4 MiB reads were the load's last resident peak
        for start in (0, size - span) if size > 2 * span else (0,):
            f.seek(start)
            left = span
            while left > 0 and (piece := f.read(min(left, 256 << 10))):
                h.update(piece)
                left -= len(piece)
    return h.hexdigest()[:32]


def stderr_progress(label: str) -> ProgressFn:
    """A progress callback printing `label: done/total` on one refreshed stderr line."""
    tty = sys.stderr.isatty()

    def report(done: int, total: int) -> None:
        if tty:
            end = "\n" if done == total else ""
            print(f"\r{label}: {done}/{total} tensors", end=end, file=sys.stderr, flush=True)

    return report


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
_LOAD_MMAP_THRESHOLD = 256 << 10
# where glibc's own adaptive thresholds end up (trim = 2 x mmap); setting one turns the
# adaptation off, and the default 128 KiB trim threshold then unmaps and refaults the heap top
# on every large free: prefill ran 25% slower
_RUN_MMAP_THRESHOLD = 32 << 20
_RUN_TRIM_THRESHOLD = 64 << 20


@contextmanager
def load_time_allocation() -> Iterator[None]:
    """While loading, every allocation of 256 KiB or more gets its own memory map, so freeing
    a temporary returns it to the OS at once; afterwards freed memory is handed back too.

    glibc otherwise raises its mmap threshold after the first large free and serves later
    temporaries from the heap, which keeps them: repacking the default model's Q8_0 head left
    about 130 MB resident, and the whole load about 190 MB, until the end.
    """
    libc = glibc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, _LOAD_MMAP_THRESHOLD)
    try:
        yield
    finally:
        if libc is not None:
            # a fixed threshold as high as glibc's adaptive one would reach: activations of
            # prefill reuse heap memory instead of mapping fresh pages every op
            libc.mallopt(_M_MMAP_THRESHOLD, _RUN_MMAP_THRESHOLD)
            libc.mallopt(_M_TRIM_THRESHOLD, _RUN_TRIM_THRESHOLD)
        release_free_memory()


def _check_against_file(gf: GGUFFile, cfg: ModelConfig, cls: type[LlamaForCausalLM],
                        dtype: torch.dtype, backend: Backend) -> None:
    """Compare the config with the file's tensors before allocating anything real."""
    src = str(gf.path)
    blocks = {int(n.split(".")[1]) for n in gf.tensors if n.startswith("blk.")
              and n.split(".")[1].isdigit()}
    if (max(blocks) + 1 if blocks else 0) != cfg.num_layers:
        raise ModelLoadError(f"{src}: metadata says {cfg.num_layers} layers but the file has "
                             f"tensors for {len(blocks)}")
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in
                  cls(cfg, dtype, backend).named_parameters(remove_duplicate=False)}
    filled: set[str] = set()
    for info in gf:
        name = module_name(info.name, cfg.arch)
        if name is None or name not in shapes:
            continue
        if info.shape != shapes[name]:
            raise ModelLoadError(f"{src}: tensor {info.name!r} has shape {info.shape}, the "
                                 f"metadata implies {shapes[name]}")
        filled.add(name)
    tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    missing = sorted(set(shapes) - filled - tied)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelLoadError(f"{src}: missing tensors for {', '.join(missing[:3])}{more}")


log = logging.getLogger("localllm")
_TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
                     "tokenizer.ggml.token_type")


def _keep_quantized(model: LlamaForCausalLM, name: str, info: TensorInfo, gf: GGUFFile
                    ) -> bool:
    """Hand a linear layer its weight in a quantized runtime format, where the backend packs
    it. Matrices are repacked a slice of rows at a time, straight from the mapped file."""
    module_path, _, attr = name.rpartition(".")
    module = model.get_submodule(module_path)
    if attr != "weight" or not isinstance(module, Linear):
        return False
    if len(info.shape) != 2 or info.data.ndim != 2 or info.data.shape[0] != info.shape[0]:
        whole = repack(info)
        packed = (module.pack(row_source(whole))
                  if isinstance(whole, (Int4Weight, Int8Weight)) else None)
    else:
        first = repack(info.data[:1], info.qtype, (1, info.shape[1]))
        if not isinstance(first, (Int4Weight, Int8Weight)):
            return False

        def rows(start: int, end: int) -> Int4Weight | Int8Weight:
            w = repack(info.data[start:end], info.qtype, (end - start, info.shape[1]))
            assert isinstance(w, (Int4Weight, Int8Weight))
            gf.release(info, (start, end))  # copied out: its file pages can go
            return w

        packed = module.pack(rows)
    if packed is None:
        return False
    replace_module(model, module, packed)
    return True


def _longrope_factors(cfg: ModelConfig) -> str | None:
    """Which LongRoPE factor tensor a model uses: the long ones when its context exceeds the
    original one (as llama.cpp does with a context that long), else the short ones."""
    sc = cfg.rope_scaling
    if sc.kind != "longrope":
        return None
    return "rope.long_factors" if cfg.context_length > sc.original_context else (
        "rope.short_factors")


def _warn_unpacked(src: str, unpacked: dict[int, list[TensorInfo]], dtype: torch.dtype,
                   backend: str) -> None:
    """One line per quantized type that had to be dequantized to the compute dtype: what it
    costs in memory (and that its matmuls run dense)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    for qtype, infos in unpacked.items():
        stored = sum(int(info.data.nbytes) for info in infos)
        dense = sum(math.prod(info.shape) * itemsize for info in infos)
        log.warning("%s: %d tensor(s) of type %s have no packed format on the %s backend: "
                    "dequantized to %s at load, %.1f MiB instead of %.1f MiB (%.1fx), with "
                    "dense matmuls", Path(src).name, len(infos), qtype_name(qtype), backend,
                    str(dtype).split(".")[-1], dense / 2**20, stored / 2**20,
                    dense / max(stored, 1))


def load_gguf(path: str | os.PathLike[str], dtype: torch.dtype = torch.bfloat16,
              progress: ProgressFn | None = None, quantized: bool | None = None,
              backend: Backend | None = None) -> LoadedModel:
    """Load a GGUF model onto `backend` (default: the CPU's). `quantized` (default: when
    computing in bf16) keeps the weights of linear layers packed where the backend has a
    packed form for their format; others are dequantized to `dtype` at load."""
    with load_time_allocation():
        return _load_gguf(path, dtype, progress, quantized, backend or make_backend("cpu"))


def _load_gguf(path: str | os.PathLike[str], dtype: torch.dtype,
               progress: ProgressFn | None, quantized: bool | None,
               backend: Backend) -> LoadedModel:
    if quantized is None:
        quantized = dtype == torch.bfloat16
    gf = GGUFFile(path)
    src = str(gf.path)
    cfg = config_of_file(gf)
    tokenizer = Tokenizer.from_gguf_metadata(gf.metadata, source=src)
    for key in _TOKENIZER_ARRAYS:  # built: ~10 MB of Python objects not needed while loading
        gf.metadata.pop(key, None)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ModelLoadError(f"{src}: tokenizer has {tokenizer.vocab_size} tokens but the "
                             f"embedding only {cfg.vocab_size}")
    cls = model_class(cfg.arch)
    _check_against_file(gf, cfg, cls, dtype, backend)
    try:
        with backend.device:
            model = cls(cfg, dtype, backend)
    except (RuntimeError, MemoryError) as e:
        raise ModelLoadError(f"{src}: cannot allocate the model ({e})") from None
    params = dict(model.named_parameters(remove_duplicate=False))
    infos = list(gf)
    unpacked: dict[int, list[TensorInfo]] = {}  # quantized tensors stored dense, by type
    for i, info in enumerate(infos):
        name = module_name(info.name, cfg.arch)
        if name == "rope.freq_factors" or name == _longrope_factors(cfg):
            model.rope.set_freq_factors(dequantize(info, src).flatten(), cfg)
        elif name is not None and name in params:
            if not (quantized and _keep_quantized(model, name, info, gf)):
                params[name].data.copy_(dequantize(info, src))
                if quantized and info.qtype not in DENSE_TYPES:
                    unpacked.setdefault(info.qtype, []).append(info)
        gf.release(info)
        if progress is not None:
            progress(i + 1, len(infos))
    _warn_unpacked(src, unpacked, dtype, backend.name)
    # the parts' packed matrices were small enough for the heap, the fused ones are not:
    # their freed space would stay until the load ends, 10-14 MB over the steady size
    model.fuse_projections(after_layer=release_free_memory)
    backend.settle_weights(model)
    model.eval()
    return LoadedModel(model, tokenizer, cfg, gf.path, file_fingerprint(gf.path), backend)
