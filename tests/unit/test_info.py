"""`localllm info`: every figure against a hand calculation written out here, and the worked-out
loaded bytes against the tensors of a model really loaded on each backend."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf_factory import ModelSpec, vocab, write_model
from held_bytes import held_bytes

from localllm.apps.cli import build_parser
from localllm.apps.cli import main as cli_main
from localllm.apps.info import model_info, render
from localllm.backends import make_backend
from localllm.kernels import cpu_native
from localllm.loader import load_gguf
from localllm.model_stats import measure_bandwidth

ROOT = Path(__file__).resolve().parents[2]
STORIES = ROOT.parent / "shared" / "models" / "stories260K.gguf"
GB = 10**9


def _info(path: Path, **kw: Any) -> dict[str, Any]:
    args = {"dtype_name": "bfloat16", "backend": "cpu", "memory": 8 * GB, "sessions_at": 4096,
            "context": 0, "bandwidth": 40e9, **kw}
    return model_info(path, **args)


@pytest.mark.skipif(not STORIES.exists(), reason="../shared/models/stories260K.gguf is absent")
def test_stories260k_by_hand() -> None:
    # dim 64, 5 layers, 8 heads / 4 KV heads of 8, FFN 172, vocab 512, separate output.weight;
    # no context_length key: the default 2048
    info = _info(STORIES)
    p = info["params"]
    assert p["embeddings"] == 512 * 64 == 32768
    assert p["attention"] == 5 * (64 * 64 + 2 * 64 * 32 + 64 * 64) == 61440
    assert p["mlp"] == 5 * 3 * 64 * 172 == 165120
    assert p["norms"] == 5 * 2 * 64 + 64 == 704
    assert p["head"] == 512 * 64 == 32768
    # the model card's 260,032 leaves out the (here untied) head
    assert p["total"] == 292800 == 260032 + 32768
    assert p["from_config"] == {k: p[k] for k in ("embeddings", "attention", "mlp", "norms",
                                                   "head")}
    w = info["weights"]
    assert w["stored"] == {"F32": {"tensors": 48, "params": 292800, "bytes": 292800 * 4}}
    for backend in ("cpu", "torch", "triton"):  # F32 tensors load dense, in bf16
        assert w["loaded"][backend]["total"] == 292800 * 2 == 585600
    kv = info["kv"]
    assert kv["bytes_per_token"] == 2 * 5 * 4 * 8 * 2 == 640
    # (8e9 - 585,600) bytes / (640 * 16 bytes a block) = 781,192.8 -> 781,192 blocks
    assert kv["tokens"] == 781192 * 16 == 12499072
    assert kv["context"] == 2048
    assert kv["sessions"] == 781192 // (4096 // 16) == 3051
    f = info["flops"]
    assert f["context"] == 2048
    assert f["decode"] == {"linear": 2 * (61440 + 165120), "head": 2 * 512 * 64,
                           "attention": 4 * 5 * 8 * 8 * 2048, "total": 453120 + 65536 + 2621440}
    pre = f["prefill"]
    assert pre["linear"] == 453120
    assert pre["head"] == 65536 / 2048 == 32
    assert pre["attention"] == 4 * 5 * 8 * 8 * 2049 / 2 == 1311360
    assert pre["total"] == 453120 + 32 + 1311360
    bw = info["bandwidth"]
    # every weight but the (untied) embedding table, and K/V of 2048 positions
    assert bw["bytes_per_step"] == 585600 - 65536 + 640 * 2048 == 1830784
    assert bw["decode_tokens_per_s"] == pytest.approx(40e9 / 1830784)


SPEC = ModelSpec(hidden=64, ffn=128, heads=4, kv_heads=2, layers=2, qtype=QT.Q4_0,
                 qtypes={"token_embd.weight": QT.Q8_0, "output.weight": QT.Q4_1})


def test_synthetic_quantized_by_hand(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_model(path, SPEC)
    v = len(vocab()[0])
    assert v == 303  # rows padded to 320 in the CPU layout
    info = _info(path, context=256, sessions_at=100, memory=10**6)
    p = info["params"]
    assert (p["embeddings"], p["attention"], p["mlp"], p["norms"], p["head"]) == (
        303 * 64, 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64), 2 * 3 * 64 * 128, 2 * 2 * 64 + 64,
        303 * 64)
    assert p["total"] == 19392 + 24576 + 49152 + 320 + 19392 == 112832
    stored = info["weights"]["stored"]
    assert stored["Q4_0"]["bytes"] == (24576 + 49152) // 32 * 18 == 41472
    assert stored["Q8_0"]["bytes"] == 19392 // 32 * 34 == 20604
    assert stored["Q4_1"]["bytes"] == 19392 // 32 * 20 == 12120
    assert stored["F32"]["bytes"] == 320 * 4
    loaded = info["weights"]["loaded"]
    assert loaded["torch"]["total"] == 112832 * 2
    # triton: codes K/2 (int4) or K (int8) bytes a row, fp16 scales (and offsets) per 32
    q, kv_, down = 64 * 64 // 2 + 2 * 64 * 2, 32 * 64 // 2 + 2 * 32 * 2, 128 * 64 // 2 + 4 * 64 * 2
    gate = 128 * 64 // 2 + 2 * 128 * 2
    assert loaded["triton"]["attention"] == 2 * (2 * q + 2 * kv_) == 13824
    assert loaded["triton"]["mlp"] == 2 * (2 * gate + down) == 27648
    assert loaded["triton"]["embeddings"] == 303 * 64 + 2 * 303 * 2 == 20604
    assert loaded["triton"]["head"] == 303 * 64 // 2 + 2 * 303 * 2 * 2 == 12120
    assert loaded["triton"]["total"] == 13824 + 27648 + 20604 + 12120 + 640
    # cpu: rows padded to 64; half = the fp16 scales alone (native kernels), else bf16
    # (scale, zero) pairs per plane and group; the embedding keeps exact scales when not half
    half = cpu_native.available()
    if half:
        q4 = {64: 2048 + 2 * 64 * 2, 32: 2048 + 2 * 64 * 2, 128: 4096 + 2 * 128 * 2}
        down_b, embed = 4096 + 4 * 64 * 2, 20480 + 2 * 320 * 2
    else:
        q4 = {64: 2048 + 2 * 64 * 4, 32: 2048 + 2 * 64 * 4, 128: 4096 + 2 * 128 * 4}
        down_b, embed = 4096 + 4 * 64 * 4, 20480 + 2 * 2 * 320 * 4 + 303 * 2 * 2
    assert loaded["cpu"]["attention"] == 2 * (2 * q4[64] + 2 * q4[32])
    assert loaded["cpu"]["mlp"] == 2 * (2 * q4[128] + down_b)
    assert loaded["cpu"]["embeddings"] == embed  # Q8_0: two planes, 320 rows
    assert loaded["cpu"]["head"] == 320 * 32 + 2 * 320 * 4 == 12800  # Q4_1: never half
    kv = info["kv"]
    assert kv["bytes_per_token"] == 2 * 2 * 2 * 16 * 2 == 256
    budget = 10**6 - loaded["cpu"]["total"]
    assert kv["tokens"] == budget // (256 * 16) * 16
    assert kv["context"] == 256  # the model's (factory) context length caps one session
    assert kv["sessions"] == budget // (256 * 16) // 7  # 100 tokens: 7 blocks
    dec = info["flops"]["decode"]
    assert dec["total"] == 2 * (24576 + 49152) + 2 * 303 * 64 + 4 * 2 * 4 * 16 * 256 == 317312


MIXED = ModelSpec(hidden=256, ffn=256, heads=4, kv_heads=2, layers=1, qtype=QT.Q4_1, tied=True,
                  qtypes={"token_embd.weight": QT.Q4_K, "blk.0.attn_k.weight": QT.Q4_K,
                          "blk.0.attn_output.weight": QT.Q6_K, "blk.0.ffn_up.weight": QT.Q5_0,
                          "blk.0.ffn_gate.weight": QT.IQ4_NL, "blk.0.ffn_down.weight": QT.F16})


@pytest.mark.parametrize("backend", ["cpu", "torch", "triton"])
def test_loaded_bytes_match_a_real_load(tmp_path: Path, backend: str) -> None:
    if backend == "triton":
        pytest.importorskip("triton")
    path = tmp_path / "mixed.gguf"
    write_model(path, MIXED)
    loaded = load_gguf(path, torch.bfloat16, backend=make_backend("cpu", backend))
    info = _info(path, backend=backend)
    assert info["weights"]["loaded"][backend]["total"] == held_bytes(loaded.model)


def test_cli_json_and_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "m.gguf"
    write_model(path, SPEC)
    assert cli_main(["info", str(path), "--json", "--bandwidth", "20", "--context", "128"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bandwidth"]["source"] == "given"
    assert out["bandwidth"]["bytes_per_s"] == 20e9
    assert out["flops"]["context"] == 128
    assert out["kv"]["session_len"] == 256  # the default 4096, capped by the model's context
    assert cli_main(["info", "--model", str(path), "--memory", "1GiB"]) == 0
    text = capsys.readouterr().out
    assert "parameters    112,832" in text and "KV cache      256 bytes/token" in text
    assert "in 1 GiB beside the" in text  # as given, not "in 1.07374 GB"
    for memory, shown in (("8GB", "8 GB"), ("512MB", "0.512 GB"), ("1.5GiB", "1.5 GiB"),
                          ("1000b", "1,000 bytes")):
        assert cli_main(["info", str(path), "--memory", memory]) == 0
        assert f"in {shown} beside the" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "origin"), [
    (["info", "{path}"], "(given as MODEL)"),
    (["info", "--model", "{path}"], "(given with --model)"),
])
def test_missing_model_names_how_it_was_given(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              argv: list[str], origin: str) -> None:
    path = tmp_path / "nope.gguf"
    assert cli_main([a.format(path=path) for a in argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"localllm: error: {path}: no such file {origin}\n"


def test_sizes_and_bandwidth() -> None:
    parse = build_parser().parse_args
    assert parse(["info", "--memory", "8GB"]).memory == 8 * GB
    assert parse(["info", "--memory", "1.5GiB"]).memory == 3 * 2**29
    assert parse(["info", "--memory", "16"]).memory == 16 * GB  # a bare number is GB here
    assert parse(["info"]).memory == 8 * GB
    assert measure_bandwidth(8 << 20, repeat=2) > 1e8  # any machine copies 100 MB/s


def test_hf_folder_by_hand(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": 100, "tie_word_embeddings": True, "max_position_embeddings": 128}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shapes = {"model.embed_tokens.weight": (100, 32), "lm_head.weight": (100, 32),
              "model.layers.0.self_attn.q_proj.weight": (32, 32),
              "model.layers.0.self_attn.k_proj.weight": (16, 32),
              "model.layers.0.self_attn.v_proj.weight": (16, 32),
              "model.layers.0.self_attn.o_proj.weight": (32, 32),
              "model.layers.0.mlp.gate_proj.weight": (64, 32),
              "model.layers.0.mlp.up_proj.weight": (64, 32),
              "model.layers.0.mlp.down_proj.weight": (32, 64),
              "model.layers.0.input_layernorm.weight": (32,),
              "model.layers.0.post_attention_layernorm.weight": (32,),
              "model.norm.weight": (32,)}
    save_file({n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()},
              str(tmp_path / "model.safetensors"))
    info = _info(tmp_path, dtype_name="float32", context=128)
    p = info["params"]
    # tied: the stored lm_head.weight is not loaded, so not counted
    assert (p["embeddings"], p["attention"], p["mlp"], p["norms"], p["head"]) == (
        100 * 32, 32 * 32 + 2 * 16 * 32 + 32 * 32, 3 * 64 * 32, 3 * 32, 0)
    assert p["total"] == 3200 + 3072 + 6144 + 96 == 12512
    assert info["weights"]["stored"] == {"BF16": {"tensors": 11, "params": 12512,
                                                  "bytes": 12512 * 2}}
    for backend in ("cpu", "torch", "triton"):
        assert info["weights"]["loaded"][backend]["total"] == 12512 * 4
    assert info["kv"]["bytes_per_token"] == 2 * 1 * 2 * 8 * 4 == 128
    # a folder whose config names no model: the first line ends with the format, and numbers
    # are grouped as elsewhere
    text = render(info)
    assert text.splitlines()[0] == f"{tmp_path} (huggingface)"
    assert "context 128, RoPE base 10,000" in text


def test_sliding_windows_cap_attention_flops_and_kv_reads() -> None:
    from localllm.config import ModelConfig
    from localllm.model_stats import attended_positions, decode_flops, prefill_flops

    # 4 layers, every other one a sliding layer with a window of 100 (Gemma 2's pattern);
    # 8 heads of 16: attention costs 4 * 8 * 16 = 512 FLOPs per position read, per layer
    cfg = ModelConfig(arch="gemma2", vocab_size=256, hidden_size=128, intermediate_size=256,
                      num_layers=4, num_heads=8, num_kv_heads=2, head_dim=16,
                      rms_norm_eps=1e-6, rope_theta=10000.0, rope_dim=16,
                      context_length=8192, rope_neox=True, tie_word_embeddings=True,
                      sliding_window=100, sliding_layers=(True, False, True, False))
    # decode at context 1000: two global layers read 1000 positions, two sliding ones 100
    assert attended_positions(cfg, 1000) == 2 * 1000 + 2 * 100
    assert decode_flops(cfg, 1000).attention == 512 * 2200
    # shorter than the window: every layer reads the whole context
    assert attended_positions(cfg, 60) == 4 * 60
    # prefill of 400: a global layer's position i reads i + 1, mean (400 + 1) / 2 = 200.5;
    # a sliding layer's reads min(i + 1, 100): (1 + ... + 100 + 300 * 100) / 400
    #   = (5050 + 30000) / 400 = 87.625
    assert prefill_flops(cfg, 400).attention == pytest.approx(512 * (2 * 200.5 + 2 * 87.625))
    # Mistral-style (every layer slides): decode reads only the window in every layer
    mistral = ModelConfig(**{**cfg.__dict__, "arch": "mistral", "sliding_layers": ()})
    assert attended_positions(mistral, 1000) == 4 * 100
