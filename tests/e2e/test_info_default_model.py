"""`localllm info` on the default model: hand-checked figures and the CPU backend's real load."""

from __future__ import annotations

from pathlib import Path

import torch
from held_bytes import held_bytes

from localllm.apps.info import model_info
from localllm.kernels import cpu_native
from localllm.loader import load_gguf


def test_default_model_by_hand_and_loaded(smollm_path: Path) -> None:
    # 30 layers, hidden 576, 9 heads / 3 KV heads of 64, MLP 1536, vocab 49152, tied head;
    # Q4_1 projections, Q8_0 embedding, F32 norms
    info = model_info(smollm_path, "bfloat16", "cpu", 8 * 10**9, 4096, 8192, 40e9)
    p = info["params"]
    assert p["embeddings"] == 49152 * 576 == 28311552
    assert p["attention"] == 30 * (2 * 576 * 576 + 2 * 576 * 192) == 26542080
    assert p["mlp"] == 30 * 3 * 576 * 1536 == 79626240
    assert p["norms"] == 30 * 2 * 576 + 576 == 35136
    assert p["head"] == 0 and p["total"] == 134515008
    assert info["kv"]["bytes_per_token"] == 2 * 30 * 3 * 64 * 2 == 23040
    stored = info["weights"]["stored"]
    assert stored["Q4_1"]["bytes"] == (26542080 + 79626240) // 32 * 20
    assert stored["Q8_0"]["bytes"] == 28311552 // 32 * 34
    cpu = info["weights"]["loaded"]["cpu"]
    # Q8_0 as two 4-bit planes, 49152 rows (a multiple of 64), 576 code bytes a row, and
    # 18 groups: fp16 scales alone with the native kernels, else bf16 (scale, zero) pairs per
    # plane plus the exact fp16 scales
    scales = 18 * 49152 * 2 if cpu_native.available() else 2 * 18 * 49152 * 4 + 18 * 49152 * 2
    assert cpu["embeddings"] == 49152 * 576 + scales
    model = load_gguf(smollm_path, torch.bfloat16).model
    assert held_bytes(model) == cpu["total"]
