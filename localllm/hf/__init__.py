"""Hugging Face checkpoint folders: config.json, tokenizer.json and safetensors weights."""

from localllm.hf.loader import is_hf_checkpoint, load_hf

__all__ = ["is_hf_checkpoint", "load_hf"]
