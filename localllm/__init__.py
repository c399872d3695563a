"""localllm: a single-process local LLM runtime."""

from localllm.config import CacheConfig, SamplingParams, SchedulerConfig
from localllm.errors import LocalLLMError, ModelLoadError, RequestError, TemplateError

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


def __getattr__(name: str) -> object:
    # LLM pulls in torch and the engine; import it only when asked for.
    if name == "LLM":
        from localllm.llm import LLM

        return LLM
    raise AttributeError(name)
