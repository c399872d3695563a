"""GGUF `general.architecture` -> model class, and the interface the engine needs of a model."""

from __future__ import annotations

from typing import Protocol

import torch

from localllm.config import SUPPORTED_ARCHS, ModelConfig, unsupported_architecture
from localllm.errors import ModelLoadError
from localllm.layers.attention import AttentionMetadata, KVCache
from localllm.layers.backend import Backend
from localllm.layers.stack import DecoderLayout
from localllm.models.llama import LlamaForCausalLM


class CausalLM(Protocol):
    """What the loaders, the model runner and the engine use of a model."""

    cfg: ModelConfig
    dtype: torch.dtype
    backend: Backend

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def decoder_layout(self) -> DecoderLayout: ...


# one class over config flags (see `localllm.models.llama`)
_REGISTRY: dict[str, type[LlamaForCausalLM]] = {arch: LlamaForCausalLM
                                                for arch in SUPPORTED_ARCHS}


def model_class(arch: str) -> type[LlamaForCausalLM]:
    try:
        return _REGISTRY[arch]
    except KeyError:
        raise ModelLoadError(unsupported_architecture(arch, list(_REGISTRY))) from None
