"""The backend seam: choosing a backend, the PyTorch backend against the CPU backend on the
same weights, and the layering rules (models declare modules, only backends import kernels,
no import cycles)."""

from __future__ import annotations

import ast
import importlib.util
import os
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf_factory import ModelSpec, write_model

from localllm import LLM, SamplingParams
from localllm.apps.cli import main as cli_main
from localllm.backends import make_backend
from localllm.backends.cpu import CpuBackend
from localllm.backends.pytorch.backend import TorchBackend
from localllm.engine.model_runner import prompt_logits
from localllm.errors import RequestError
from localllm.layers.linear import Linear, QuantLinear
from localllm.loader import load_gguf

ROOT = Path(__file__).resolve().parents[2]
# the source folders and the package each is imported as (pyproject's package-dir)
PACKAGES = {"localllm": ROOT / "localllm", "localllm.kernels": ROOT / "kernels",
            "localllm.models": ROOT / "models", "localllm.apps": ROOT / "apps"}
SPEC = ModelSpec(hidden=64, ffn=128, heads=4, kv_heads=2, layers=2, qtype=QT.Q4_0,
                 qtypes={"token_embd.weight": QT.Q8_0})


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("backends") / "m.gguf", SPEC).path


def test_auto_takes_the_cpu_without_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU: auto takes it")
    backend = make_backend("auto")
    assert isinstance(backend, CpuBackend) and backend.device.type == "cpu"


def test_cuda_without_a_gpu_is_a_one_line_error(capsys: pytest.CaptureFixture[str],
                                                model_file: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    with pytest.raises(RequestError, match="no CUDA GPU"):
        make_backend("cuda")
    with pytest.raises(RequestError, match="unknown device 'tpu'"):
        make_backend("tpu")
    rc = cli_main(["generate", "--model", str(model_file), "--device", "cuda", "Hello"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("localllm: error: --device cuda")


def test_backend_names_pick_their_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(make_backend("cpu", "torch"), TorchBackend)
    assert isinstance(make_backend("cpu", "cpu"), CpuBackend)
    with pytest.raises(RequestError, match="unknown backend 'numpy'"):
        make_backend("cpu", "numpy")
    if importlib.util.find_spec("triton") is None:
        with pytest.raises(RequestError, match="triton is not installed"):
            make_backend("cpu", "triton")
        return
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RequestError, match="set TRITON_INTERPRET=1"):
        make_backend("cpu", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    backend = make_backend("cpu", "triton")
    assert backend.name == "triton" and backend.device.type == "cpu"


def test_triton_backend_on_a_quantized_model(model_file: Path) -> None:
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1"  # conftest.py sets it
    ids = [1 + (5 * i) % 60 for i in range(12)]
    exact = prompt_logits(load_gguf(model_file, torch.float32).model, ids)
    model = load_gguf(model_file, torch.bfloat16, backend=make_backend("auto", "triton")).model
    assert isinstance(model.layers[0].self_attn.o_proj, QuantLinear)
    scale = float(exact.abs().max())
    for chunk in (0, 1):  # one prompt (extend attention, GEMM), then decode steps (GEMV)
        got = prompt_logits(model, ids, chunk=chunk)
        assert float((got - exact).abs().max()) < 0.05 * scale


def test_pytorch_backend_matches_the_cpu_backend(model_file: Path) -> None:
    ids = [1 + (5 * i) % 60 for i in range(40)]
    torch_backend = TorchBackend(torch.device("cpu"))
    # fp32: both dequantize every weight exactly and run the same math
    exact = prompt_logits(load_gguf(model_file, torch.float32).model, ids)
    on_torch = load_gguf(model_file, torch.float32, backend=torch_backend).model
    torch.testing.assert_close(prompt_logits(on_torch, ids), exact, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(prompt_logits(on_torch, ids, chunk=1), exact, rtol=1e-5,
                               atol=1e-5)
    # bf16: the CPU backend keeps the weights packed, the PyTorch one holds them dense
    packed = load_gguf(model_file, torch.bfloat16).model
    dense = load_gguf(model_file, torch.bfloat16, backend=torch_backend).model
    assert isinstance(packed.layers[0].self_attn.o_proj, QuantLinear)
    assert isinstance(dense.layers[0].self_attn.o_proj, Linear)
    scale = float(exact.abs().max())
    for model in (packed, dense):
        for chunk in (0, 1):
            got = prompt_logits(model, ids, chunk=chunk)
            assert float((got - exact).abs().max()) < 0.05 * scale


def _imports(path: Path, name: str) -> set[str]:
    """Every module `path` imports (also inside functions and TYPE_CHECKING blocks)."""
    out: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        for f in folder.rglob("*.py"):
            parts = list(f.relative_to(folder).with_suffix("").parts)
            if package == "localllm" and parts[0] in ("kernels", "models", "apps"):
                continue
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join([package, *parts])] = f
    return mods


def _graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports, counting the packages whose `__init__` an
    import runs (`a.b.c` runs `a.b`)."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps: set[str] = set()
        for imp in _imports(path, name):
            parts = imp.split(".")
            for k in range(2, len(parts) + 1):
                dep = ".".join(parts[:k])
                if dep in mods and dep != name and not name.startswith(dep + "."):
                    deps.add(dep)
        graph[name] = deps
    return graph


def test_only_backends_import_kernels_and_models_import_no_backend() -> None:
    # each kernel family belongs to one backend: cpu_* to backends/cpu, triton_* to
    # backends/triton; models declare modules and import neither kernels nor backends
    owners = {"localllm.kernels.cpu_": "localllm.backends.cpu",
              "localllm.kernels.triton_": "localllm.backends.triton"}
    for name, path in _modules().items():
        imports = _imports(path, name) - {"localllm.kernels"}
        if name.startswith("localllm.kernels"):
            continue
        for imp in imports:
            if imp.startswith("localllm.kernels"):
                owner = next(o for prefix, o in owners.items() if imp.startswith(prefix))
                assert name.startswith(owner), f"{name} imports {imp}"
        if name.startswith("localllm.models"):
            assert not any(i.startswith("localllm.backends") for i in imports), name


def test_no_import_cycles() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep):] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_static_decode_step_matches_the_eager_step(model_file: Path) -> None:
    # the buffers, padding and seeded metadata of the Triton backend's CUDA-graph step, run
    # eagerly (capture=False): 3 sequences padded to 4, then 1 alone
    pytest.importorskip("triton")
    from localllm.backends.triton.graphs import StaticDecodeStep

    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompts = [[1, 5, 9, 13, 17], [1, 7, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
                                              16, 17, 18]]
    outs = []
    for static in (False, True):
        llm = LLM(model_file, backend="triton", device="cpu")
        runner = llm.engine.runner
        if static:
            step = StaticDecodeStep(llm.loaded.model.decoder_layout(), runner._model_forward,
                                    capture=False)
            calls: list[bool] = []

            def counted(*args: object, step: StaticDecodeStep = step,
                        calls: list[bool] = calls) -> object:
                out = step(*args)  # type: ignore[arg-type]
                calls.append(out is not None)
                return out

            runner._whole_step, runner._whole_step_built = counted, True
        outs.append([c.token_ids for c in llm.generate(prompts, params)]
                    + [llm.generate([prompts[0]], params)[0].token_ids])
        if static:
            assert sum(calls) >= 2 * (params.max_tokens - 1)  # the decode steps took it
    assert outs[0] == outs[1]


def test_every_package_is_installed() -> None:
    # a package missing from pyproject's list works in an editable install only
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {name for name, path in _modules().items() if path.name == "__init__.py"}
    assert found == listed


def test_unsupported_architecture_lists_the_supported_ones_in_one_line() -> None:
    from localllm.config import SUPPORTED_ARCHS
    from localllm.errors import ModelLoadError
    from localllm.models.registry import model_class

    with pytest.raises(ModelLoadError) as e:
        model_class("mamba")
    msg = str(e.value)
    assert msg == ("unsupported architecture 'mamba' (supported: gemma2, gemma3, llama, "
                   "mistral, phi3, qwen2, qwen3)")
    assert all(model_class(a) is not None for a in SUPPORTED_ARCHS)
