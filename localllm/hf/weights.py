"""The tensors of a Hugging Face checkpoint folder: `*.safetensors`, one file or sharded.

Files are opened with `safetensors.safe_open` (memory-mapped); `get` reads one tensor at a time,
so loading never holds a second full copy of the weights.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from localllm.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"


def _weight_files(folder: Path) -> list[Path]:
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{index}: unreadable safetensors index ({e})") from None
        files = [folder / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{folder}: shard {missing[0]} named in {INDEX_FILE} is missing")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        other = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pth")]
        hint = f" ({other[0]} is a pickle checkpoint; convert it to safetensors)" if other else ""
        raise ModelLoadError(f"{folder}: no *.safetensors weights{hint}")
    return files


class SafetensorsFolder:
    """Name -> tensor across the folder's safetensors files. Use as a context manager."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        self.folder = folder
        self.files = _weight_files(folder)
        self._stack = ExitStack()
        self._handles: dict[str, Any] = {}  # tensor name -> its open file
        try:
            for file in self.files:
                handle = self._stack.enter_context(safe_open(str(file), framework="pt"))
                for name in handle.keys():
                    self._handles.setdefault(name, handle)
        except Exception as e:  # safetensors raises its own error types for bad headers
            self._stack.close()
            raise ModelLoadError(f"{folder}: unreadable safetensors file ({e})") from None

    def __enter__(self) -> SafetensorsFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def names(self) -> list[str]:
        return list(self._handles)

    def __contains__(self, name: str) -> bool:
        return name in self._handles

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[name].get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The stored dtype's safetensors name ("BF16", "F32", "U8"...), read from the header."""
        return str(self._handles[name].get_slice(name).get_dtype())

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._handles[name].get_tensor(name)
        except Exception as e:
            raise ModelLoadError(f"{self.folder}: cannot read tensor {name!r} ({e})") from None
