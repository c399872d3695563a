"""Load a model and its tokenizer from a Hugging Face checkpoint folder.

The folder holds `config.json`, `tokenizer.json` (+ `tokenizer_config.json`,
`generation_config.json`) and `*.safetensors` weights in fp16/bf16/fp32, possibly sharded with
`model.safetensors.index.json`, or bitsandbytes 4-bit/8-bit weights saved by transformers.
HF tensor names are localllm's module names with a `model.` prefix (`lm_head.weight` as is; a
multimodal Gemma 3's text model under `language_model.model.` or `model.language_model.`;
Phi-3's stacked `qkv_proj` and `gate_up_proj` load as they are). Gemma's norms multiply by
(1 + w): their weights get the 1 added at load, as llama.cpp's converter stores them.

`quantize` ("int8" | "int4" | "nf4") quantizes the weights of linear layers (not the
embedding or the LM head) on load, see `localllm.quant.quantize`. Where the backend has a
packed form for the result (`Linear.pack`; with bf16 compute the CPU backend packs int4 in
groups of 32, NF4 where its native kernels run, and per-channel int8; the Triton backend all
three) it stays packed; otherwise, and for every weight with fp32
compute, it is stored dequantized in the compute dtype: it carries the quantization error, not
its memory savings. Bitsandbytes checkpoints are dequantized at load and, with `quantize`,
quantized again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from localllm.backends import make_backend
from localllm.config import ModelConfig
from localllm.errors import ModelLoadError
from localllm.hf.bnb import bnb_method, bnb_shape, dequantize_bnb, is_bnb_weight
from localllm.hf.config import config_from_hf
from localllm.hf.weights import SafetensorsFolder
from localllm.layers.backend import Backend
from localllm.layers.linear import Linear, replace_module, row_source
from localllm.loader import LoadedModel, ProgressFn, file_fingerprint, load_time_allocation
from localllm.memory import release_free_memory
from localllm.models.llama import LlamaForCausalLM
from localllm.models.registry import model_class
from localllm.quant.quantize import QUANTIZE_MODES, quantize
from localllm.text.tokenizer import Tokenizer

QUANT_GROUP = 32


def is_hf_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether `path` should load as a Hugging Face folder (rather than a GGUF file)."""
    return Path(path).is_dir()


# the text model inside a multimodal checkpoint (Gemma 3 4B+): under transformers 5's module
# names, or as checkpoints store them
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.")


def local_name(hf_name: str) -> str | None:
    """`model.layers.0.self_attn.q_proj.weight` -> `layers.0.self_attn.q_proj.weight`."""
    for prefix in _TEXT_PREFIXES:
        if hf_name.startswith(prefix):
            return hf_name[len(prefix):]
    if hf_name.startswith("model."):
        return hf_name[len("model."):]
    return "lm_head.weight" if hf_name in ("lm_head.weight",
                                           "language_model.lm_head.weight") else None


def read_config(folder: Path) -> dict[str, Any]:
    file = folder / "config.json"
    if not file.is_file():
        raise ModelLoadError(f"{folder}: no config.json (not a Hugging Face checkpoint folder)")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{file}: unreadable JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{file}: not a JSON object")
    return data


def _tensor_map(st: SafetensorsFolder, cfg: ModelConfig, cls: type[LlamaForCausalLM],
                dtype: torch.dtype, bnb: bool, backend: Backend) -> dict[str, str]:
    """Check every tensor's shape against the config before allocating anything real;
    returns parameter name -> checkpoint tensor name."""
    src = str(st.folder)
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in
                  cls(cfg, dtype, backend).named_parameters(remove_duplicate=False)}
    local = [name for name in map(local_name, st.names()) if name is not None]
    layers = {int(n.split(".")[1]) for n in local
              if n.startswith("layers.") and n.split(".")[1].isdigit()}
    if layers and max(layers) + 1 != cfg.num_layers:
        raise ModelLoadError(f"{src}: config.json says {cfg.num_layers} layers but the weights "
                             f"have tensors for {max(layers) + 1}")
    found: dict[str, str] = {}
    for hf_name in st.names():
        name = local_name(hf_name)
        if name is None or name not in shapes:
            continue
        shape = bnb_shape(st, hf_name) if bnb else st.shape(hf_name)
        if shape != shapes[name]:
            raise ModelLoadError(f"{src}: tensor {hf_name!r} has shape {shape}, config.json "
                                 f"implies {shapes[name]}")
        found[name] = hf_name
    if cfg.tie_word_embeddings:
        found.pop("lm_head.weight", None)  # the embedding is the LM head
        shapes.pop("lm_head.weight")
    missing = sorted(set(shapes) - set(found))
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        names = ", ".join("model." + n if n != "lm_head.weight" else n for n in missing[:3])
        raise ModelLoadError(f"{src}: missing tensors {names}{more}")
    return found


def _fingerprint(folder: Path, files: list[Path], quantize_mode: str | None) -> str:
    h = hashlib.sha256((folder / "config.json").read_bytes())
    for file in files:
        h.update(f"{file.name}:{file_fingerprint(file)}".encode())
    h.update(f"quantize={quantize_mode}".encode())
    return h.hexdigest()[:32]


def _linear(model: LlamaForCausalLM, name: str) -> Linear | None:
    """The Linear whose weight `name` is, except the embedding and the LM head (kept in the
    compute dtype: quantizing them on load costs more quality than it saves)."""
    module_path, _, attr = name.rpartition(".")
    module = model.get_submodule(module_path)
    if (attr != "weight" or not isinstance(module, Linear)
            or name in ("lm_head.weight", "embed_tokens.weight")):
        return None
    return module


def _load_linear(model: LlamaForCausalLM, module: Linear, param: torch.Tensor,
                 w: torch.Tensor, quantize_mode: str | None) -> None:
    if quantize_mode is None or w.shape[1] % QUANT_GROUP:
        param.data.copy_(w)
        return
    qw = quantize(w, quantize_mode)
    packed = module.pack(row_source(qw))
    if packed is not None:
        replace_module(model, module, packed)
    else:
        param.data.copy_(qw.dequantize())


def load_hf(path: str | os.PathLike[str], dtype: torch.dtype = torch.bfloat16,
            progress: ProgressFn | None = None, quantize: str | None = None,
            backend: Backend | None = None) -> LoadedModel:
    """Load a Hugging Face checkpoint folder onto `backend` (default: the CPU's; see the
    module docstring)."""
    with load_time_allocation():
        return _load_hf(path, dtype, progress, quantize, backend or make_backend("cpu"))


def _load_hf(path: str | os.PathLike[str], dtype: torch.dtype, progress: ProgressFn | None,
             quantize: str | None, backend: Backend) -> LoadedModel:
    if quantize is not None and quantize not in QUANTIZE_MODES:
        raise ValueError(f"quantize must be one of {QUANTIZE_MODES}, got {quantize!r}")
    folder = Path(path)
    if not folder.is_dir():
        raise ModelLoadError(f"{folder}: not a Hugging Face checkpoint folder")
    src = str(folder)
    raw = read_config(folder)
    try:
        cfg = config_from_hf(raw)
        bnb = bnb_method(raw.get("quantization_config"))
    except ModelLoadError as e:
        raise ModelLoadError(f"{src}: {e}") from None
    if bnb is not None and quantize is not None:
        raise ModelLoadError(f"{src}: the weights are already bitsandbytes {bnb}; drop "
                             f"--quantize {quantize}")
    if not cfg.name:
        cfg = dataclasses.replace(cfg, name=folder.name)
    tokenizer = Tokenizer.from_tokenizer_json(folder)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ModelLoadError(f"{src}: tokenizer has {tokenizer.vocab_size} tokens but the "
                             f"embedding only {cfg.vocab_size}")
    cls = model_class(cfg.arch)
    with SafetensorsFolder(folder) as st:
        tensors = _tensor_map(st, cfg, cls, dtype, bnb is not None, backend)
        try:
            with backend.device:
                model = cls(cfg, dtype, backend)
        except (RuntimeError, MemoryError) as e:
            raise ModelLoadError(f"{src}: cannot allocate the model ({e})") from None
        params = dict(model.named_parameters(remove_duplicate=False))
        for i, (name, hf_name) in enumerate(sorted(tensors.items())):
            bnb_weight = bnb is not None and is_bnb_weight(st, hf_name)
            w = dequantize_bnb(st, hf_name) if bnb_weight else st.get(hf_name)
            module = _linear(model, name)
            if cfg.post_norms and name.endswith("norm.weight"):
                w = w.float() + 1.0  # Gemma's RMSNorm multiplies by (1 + w)
            if module is not None:
                _load_linear(model, module, params[name], w, quantize)
            else:
                params[name].data.copy_(w)
            del w
            if progress is not None:
                progress(i + 1, len(tensors))
        fingerprint = _fingerprint(folder, st.files, quantize)
    # the parts' packed matrices were small enough for the heap, the fused ones are not:
    # their freed space would stay until the load ends, 10-14 MB over the steady size
    model.fuse_projections(after_layer=release_free_memory)
    backend.settle_weights(model)
    model.eval()
    return LoadedModel(model, tokenizer, cfg, folder, fingerprint, backend)
