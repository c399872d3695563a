"""localllm: a single-process local LLM runtime."""

from typing import TYPE_CHECKING

from localllm.errors import LocalLLMError, ModelLoadError, RequestError, TemplateError

if TYPE_CHECKING:
    from localllm.config import CacheConfig, SamplingParams, SchedulerConfig
    from localllm.llm import LLM

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CacheConfig",
    "LocalLLMError",
    "ModelLoadError",
    "RequestError",
    "SamplingParams",
    "SchedulerConfig",
    "TemplateError",
]

_CONFIG_NAMES = ("CacheConfig", "SamplingParams", "SchedulerConfig")


def __getattr__(name: str) -> object:
    # These pull in torch (and LLM the engine): import them only when asked for, so that
    # `localllm --help` is quick and the CLI's Ctrl-C handling is in place before torch loads.
    if name == "LLM":
        from localllm.llm import LLM

        return LLM
    if name in _CONFIG_NAMES:
        import localllm.config

        return getattr(localllm.config, name)
    raise AttributeError(name)
