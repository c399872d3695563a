"""What a loaded model is, in words a person reads: its name, size, quantization and context.

Shared by `serve`'s model routes and the apps' banner. Counts come from the config (no weights
are read; `localllm.model_stats.param_counts`, tied embeddings counted once).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localllm.config import ModelConfig
from localllm.model_stats import param_counts

_QUANT_SUFFIXES = ("f32", "f16", "bf16", "q8_0", "q6_k", "q5_k_m", "q5_k_s", "q5_0", "q5_1",
                   "q4_k_m", "q4_k_s", "q4_0", "q4_1", "q3_k_m", "q3_k_s", "q3_k_l", "q2_k",
                   "iq4_nl", "iq4_xs")


def parameter_count(c: ModelConfig) -> int:
    return param_counts(c).total


def size_label(n: int) -> str:
    """135M, 1.54B: the short form model names use."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def quantization(metadata: dict[str, Any]) -> str:
    """The GGUF's file type (Q4_1, Q4_K_M, F16...), or "unknown"."""
    file_type = metadata.get("general.file_type")
    if isinstance(file_type, int):
        import gguf

        try:
            return gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_")
        except ValueError:
            pass
    return "unknown"


def gguf_scalars(path: Path) -> dict[str, Any]:
    """The GGUF's scalar metadata keys (file type, FIM token ids...), or nothing for a
    checkpoint folder."""
    if not path.is_file():
        return {}
    from localllm.gguf.reader import GGUFFile

    meta = GGUFFile(path).metadata
    return {k: v for k, v in meta.items() if isinstance(v, (int, float, str))}


def display_name(path: Path) -> str:
    """The name a user downloaded: the file or folder name without `.gguf` and quant suffix."""
    stem = path.name.removesuffix(".gguf")
    for sep in (".", "-", "_"):
        head, _, tail = stem.rpartition(sep)
        if head and tail.lower() in _QUANT_SUFFIXES:
            return head
    return stem


def file_size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(
        f.stat().st_size for f in path.iterdir() if f.is_file())


@dataclass(frozen=True)
class ModelCard:
    name: str  # what a person calls it: SmolLM2-135M-Instruct
    arch: str
    parameters: int | None
    quantization: str  # Q4_1, int4 (on load), bf16... or "unknown"
    size_bytes: int | None  # on disk
    context: int | None  # the context length served
    runs_on: str  # "cpu backend on cpu", or where a remote server is

    def banner(self) -> str:
        """One line: `SmolLM2-135M-Instruct · 135M llama · Q4_1 · 94 MiB · 8,192-token context
        · cpu backend on cpu`."""
        parts = [self.name]
        if self.parameters:
            parts.append(f"{size_label(self.parameters)} {self.arch}".strip())
        if self.quantization and self.quantization != "unknown":
            parts.append(self.quantization)
        if self.size_bytes:
            parts.append(_bytes(self.size_bytes))
        if self.context:
            parts.append(f"{self.context:,}-token context")
        parts.append(self.runs_on)
        return " · ".join(parts)


def _bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def local_card(path: Path, config: ModelConfig, metadata: dict[str, Any], context: int,
               runs_on: str, quantize: str | None = None) -> ModelCard:
    quant = quantization(metadata) if path.is_file() else (
        f"{quantize} (on load)" if quantize else "unquantized")
    return ModelCard(name=display_name(path), arch=config.arch,
                     parameters=parameter_count(config), quantization=quant,
                     size_bytes=file_size(path), context=context, runs_on=runs_on)
