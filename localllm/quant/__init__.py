"""Runtime weight formats (int4/int8 grouped) and lossless repacking of GGUF tensors."""

from localllm.quant.formats import Int4Weight, Int8Weight
from localllm.quant.repack import repack

__all__ = ["Int4Weight", "Int8Weight", "repack"]
