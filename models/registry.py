"""GGUF `general.architecture` -> model class."""

from __future__ import annotations

from localllm.errors import ModelLoadError
from localllm.models.llama import LlamaForCausalLM

_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
}


def model_class(arch: str) -> type[LlamaForCausalLM]:
    try:
        return _REGISTRY[arch]
    except KeyError:
        raise ModelLoadError(
            f"unsupported architecture {arch!r} (supported: {', '.join(sorted(_REGISTRY))})"
        ) from None
