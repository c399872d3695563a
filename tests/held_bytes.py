"""The bytes a loaded model's weights really hold, to check `localllm.weight_bytes`."""

from __future__ import annotations

import torch


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct tensor storage a loaded model's weights hold (parameters, and
    the tensors inside packed weights), RoPE tables left out."""
    seen: dict[int, int] = {}

    def add(obj: object, depth: int = 0) -> None:
        if isinstance(obj, torch.Tensor):
            s = obj.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
        elif isinstance(obj, (tuple, list)):
            for o in obj:
                add(o, depth)
        elif depth < 3 and hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module):
            for o in vars(obj).values():
                add(o, depth + 1)

    for m in model.modules():
        for t in m.parameters(recurse=False):
            add(t)
        if hasattr(m, "qweight"):
            add(m.qweight)
    return sum(seen.values())
