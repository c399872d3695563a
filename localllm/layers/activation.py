"""Activation functions of the MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from localllm.kernels import cpu_native


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    # gate, up: [num_tokens, intermediate]
    return F.silu(gate) * up


def silu_and_mul_fused(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up: [num_tokens, 2 * intermediate] (gate | up) -> [num_tokens, intermediate]
    if (gate_up.dtype == torch.bfloat16 and gate_up.dim() == 2 and gate_up.stride(1) == 1
            and gate_up.device.type == "cpu" and cpu_native.available()):
        return cpu_native.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return silu_and_mul(gate, up)
