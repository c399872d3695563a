"""GGUF reading: memory-mapped file access, metadata to config, tensor names and quant types."""

from localllm.gguf.reader import GGUFFile

__all__ = ["GGUFFile"]
