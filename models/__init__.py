"""Model definitions (declare modules only) and the architecture registry."""

from localllm.models.registry import model_class

__all__ = ["model_class"]
