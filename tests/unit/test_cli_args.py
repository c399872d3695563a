"""Command-line values out of range are refused while the arguments are parsed: argparse's
usage error, exit status 2, one `error:` line naming the option and the value, nothing loaded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from localllm import LLM
from localllm.apps.cli import build_parser
from localllm.apps.cli import main as cli_main
from localllm.config import SchedulerConfig
from localllm.errors import RequestError

REFUSED = [
    # (arguments, the error line's end)
    (["generate", "--kv-cache-memory", "-1", "hi"],
     "argument --kv-cache-memory: not a size: '-1' (such as 4G, 512M or 8GB; a bare number is "
     "GiB)"),
    (["generate", "--kv-cache-memory", "0", "hi"],
     "argument --kv-cache-memory: must be at least 1 byte, got 0"),
    (["generate", "--kv-cache-memory", "nan", "hi"],
     "argument --kv-cache-memory: not a size: 'nan' (such as 4G, 512M or 8GB; a bare number is "
     "GiB)"),
    (["info", "--memory", "lots"],
     "argument --memory: not a size: 'lots' (such as 4G, 512M or 8GB; a bare number is GB)"),
    (["generate", "--threads", "-3", "hi"], "argument --threads: must be at least 1, got -3"),
    (["generate", "--threads", "0", "hi"], "argument --threads: must be at least 1, got 0"),
    (["generate", "--threads", "two", "hi"], "argument --threads: invalid int value: 'two'"),
    (["generate", "--max-model-len", "-5", "hi"],
     "argument --max-model-len: must be at least 1, got -5"),
    (["serve", "--max-model-len", "-5"], "argument --max-model-len: must be at least 1, got -5"),
    (["chat", "--max-model-len", "0"], "argument --max-model-len: must be at least 1, got 0"),
    (["generate", "--decode-steps", "0", "hi"],
     "argument --decode-steps: must be at least 1, got 0"),
    (["serve", "--port", "99999", "--api-key", "k"],
     "argument --port: must be a port number in 1..65535 (0: any free port), got 99999"),
    (["serve", "--port", "-1", "--api-key", "k"],
     "argument --port: must be a port number in 1..65535 (0: any free port), got -1"),
    (["info", "--bandwidth", "-5"], "argument --bandwidth: must be a positive number, got -5"),
    (["info", "--bandwidth", "0"], "argument --bandwidth: must be a positive number, got 0"),
    (["info", "--bandwidth", "inf"], "argument --bandwidth: must be a positive number, got inf"),
    (["info", "--sessions-at", "0"], "argument --sessions-at: must be at least 1, got 0"),
    (["info", "--context", "0"], "argument --context: must be at least 1, got 0"),
    (["info", "--context", "-4096"], "argument --context: must be at least 1, got -4096"),
]


@pytest.mark.parametrize(("argv", "message"), REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_out_of_range_values_are_usage_errors(argv: list[str], message: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:  # the parser alone: a value it let through would
        build_parser().parse_args(argv)  # otherwise load a model, or start a server
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    (line,) = [ln for ln in err.splitlines() if "error:" in ln]
    assert line == f"localllm {argv[0]}: error: {message}"


def test_values_in_range_parse() -> None:
    parse = build_parser().parse_args
    args = parse(["generate", "--threads", "2", "--max-model-len", "64",
                  "--kv-cache-memory", "0.05", "hi"])
    assert (args.threads, args.max_model_len, args.kv_cache_memory) == (2, 64, 53687092)
    defaults = parse(["generate", "hi"])  # left out: the model's context, the default KV size
    assert (defaults.threads, defaults.max_model_len, defaults.kv_cache_memory) == (None, 0, 0)
    assert parse(["serve", "--port", "65535"]).port == 65535
    assert parse(["serve", "--port", "0"]).port == 0  # any free port (the tests use it)
    info = parse(["info", "--bandwidth", "40", "--sessions-at", "2048", "--context", "1"])
    assert (info.bandwidth, info.sessions_at, info.context) == (40.0, 2048, 1)


def test_the_python_api_refuses_them_too(tmp_path: Path) -> None:
    with pytest.raises(RequestError, match="num_threads must be at least 1, got -3"):
        LLM(tmp_path / "never-read.gguf", num_threads=-3)
    with pytest.raises(ValueError, match="max_model_len must not be negative"):
        SchedulerConfig(max_model_len=-5)
    assert SchedulerConfig(max_model_len=0).max_model_len == 0  # the model's context


def test_the_console_script_starts_without_torch() -> None:
    # Ctrl-C while torch was imported at start (before main's handler) printed a traceback;
    # the package's top level now imports it only when a command or the API needs it
    code = ("import sys, localllm.apps.cli, localllm; assert 'torch' not in sys.modules; "
            "from localllm import CacheConfig, SamplingParams, SchedulerConfig, LLM; "
            "assert SamplingParams(max_tokens=3).max_tokens == 3 and LLM.__name__ == 'LLM'; "
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "ok\n"


def test_ctrl_c_while_loading_is_exit_130_without_traceback(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("localllm.llm.LLM", interrupted)
    assert cli_main(["generate", "hi"]) == 130
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize(("command", "defaults"), [
    ("generate", ["(default: 256)", "(default: 0.8)", "(default: 0.95)", "(default: 40)",
                  "(default: 0.05)", "(default: 1.0)", "(default: random)"]),
    ("chat", ["(default: 0.7)"]),
    ("summarize", ["(default: twice --max-words plus 16)", "(default: 0)"]),
])
def test_help_states_the_sampling_defaults(command: str, defaults: list[str]) -> None:
    sub = build_parser()._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
    text = " ".join(sub.format_help().split())  # as one line: help wraps anywhere
    for d in defaults:
        assert d in text
    # and they are the defaults the parser gives
    args = sub.parse_args(["x"] if command != "chat" else [])
    if command == "generate":
        assert (args.max_tokens, args.temperature, args.top_p, args.top_k, args.min_p,
                args.repeat_penalty, args.seed) == (256, 0.8, 0.95, 40, 0.05, 1.0, None)
