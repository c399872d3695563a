"""The `localllm` command line (generate, tokenize, chat) and the Python API, on real models.

Most runs call `localllm.apps.cli.main([...])` in-process; a few start the real console script
to prove that it is installed and that exit codes reach the shell.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from localllm import model_path
from localllm.apps.cli import main

QUESTION = "What is the capital of France?"
STORY = "Once upon a time"
LONG_PROMPT = "The cat sat on the mat and looked at the little dog. " * 8
SMALL_KV = ["--kv-cache-memory", "0.05"]  # 50 MiB: plenty here, and quick to allocate
GREEDY_STORIES = ["--dtype", "float32", "--temperature", "0"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def no_user_model_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither $LOCALLLM_MODEL nor the user's config file may pick the model in these tests."""
    monkeypatch.delenv(model_path.ENV_VAR, raising=False)
    monkeypatch.setattr(model_path, "config_file", lambda: tmp_path / "no-config.toml")


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def cli_quiet(*args: str) -> tuple[int, str, str]:
    """main() without capsys (for module-scoped fixtures)."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(list(args))
    return rc, out.getvalue(), err.getvalue()


def subprocess_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != model_path.ENV_VAR}
    env["XDG_CONFIG_HOME"] = str(tmp_path)  # no user config file
    env["XDG_STATE_HOME"] = str(tmp_path)
    env["XDG_DATA_HOME"] = str(tmp_path)  # chat's saved conversations
    env["OMP_NUM_THREADS"] = "1"
    return env


def console_script() -> str:
    script = Path(sys.executable).parent / "localllm"
    found = str(script) if script.is_file() else shutil.which("localllm")
    if not found:
        pytest.fail("the `localllm` console script is not installed next to the interpreter")
    return found


def the_error_line(err: str) -> str:
    """The one `localllm: error:` line; any other stderr lines are bracketed status lines."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("localllm: error: ")]
    assert len(errors) == 1, err
    assert all(ln.startswith("[") for ln in lines if ln not in errors), err
    return errors[0]


# ------------------------------------------------------------------------ generate


def test_generate_chat_default_model_says_paris(capsys: pytest.CaptureFixture[str],
                                                smollm_path: Path) -> None:
    rc, out, err = cli(capsys, "generate", "--chat", "--temperature", "0", "--max-tokens", "30",
                       *SMALL_KV, QUESTION)
    assert rc == 0, err
    assert "Paris" in out
    # stdout holds only the reply: no statistics, no control tokens
    assert out.endswith("\n") and out.strip()
    assert "tokens/s" not in out and "load" not in out and "<|im_end|>" not in out
    assert "tokens/s" in err and "| stop]" in err


@pytest.fixture(scope="module")
def stories_greedy(stories_path: Path) -> str:
    """Greedy stories260K text of 40 tokens, the reference for the stop-string tests."""
    rc, out, err = cli_quiet("generate", "-m", str(stories_path), *GREEDY_STORIES,
                             "--max-tokens", "40", STORY)
    assert rc == 0, err
    assert out.endswith("\n")
    return out[:-1]


def test_generate_greedy_is_deterministic(capsys: pytest.CaptureFixture[str],
                                          stories_path: Path, stories_greedy: str) -> None:
    args = ["generate", "-m", str(stories_path), *GREEDY_STORIES, "--max-tokens", "20", STORY]
    rc1, out1, err1 = cli(capsys, *args)
    rc2, out2, _ = cli(capsys, *args)
    assert rc1 == rc2 == 0
    assert out1 == out2
    assert len(out1.strip()) > 10
    assert stories_greedy.startswith(out1[:-1])  # 20 greedy tokens prefix 40 greedy tokens
    assert "20 tokens" in err1 and "| length]" in err1


def test_generate_seeded_sampling(capsys: pytest.CaptureFixture[str], stories_path: Path) -> None:
    def run(seed: int) -> str:
        rc, out, err = cli(capsys, "generate", "-m", str(stories_path), "--dtype", "float32",
                           "--seed", str(seed), "--temperature", "0.9", "--max-tokens", "30",
                           STORY)
        assert rc == 0, err
        return out

    a, b, c = run(5), run(5), run(6)
    assert a == b
    assert a != c


@pytest.mark.parametrize(
    "stop",
    [
        ["Lily."],  # two tokens: " Lily" + "."
        ["outside"],  # " " + "out" + "s" + "id" + "e": starts at a token boundary
        ["tsi"],  # "out" + "s" + "id": starts and ends inside tokens
        ["park", "named"],  # the earliest of several stop strings wins
    ],
)
def test_generate_stop_string(capsys: pytest.CaptureFixture[str], stories_path: Path,
                              stories_greedy: str, stop: list[str]) -> None:
    hits = [stories_greedy.find(s) for s in stop]
    assert all(i > 0 for i in hits), (stories_greedy, stop)  # the greedy text contains them
    cut = min(hits)
    args = ["generate", "-m", str(stories_path), *GREEDY_STORIES, "--max-tokens", "40"]
    for s in stop:
        args += ["--stop", s]
    rc, out, err = cli(capsys, *args, STORY)
    assert rc == 0, err
    assert out == stories_greedy[:cut] + "\n"
    assert not any(s in out for s in stop)
    assert "| stop]" in err


def test_generate_stop_string_absent_runs_to_length(capsys: pytest.CaptureFixture[str],
                                                    stories_path: Path,
                                                    stories_greedy: str) -> None:
    stop = "xyzzy"  # a held-back prefix must come out at the end
    assert stop not in stories_greedy
    rc, out, err = cli(capsys, "generate", "-m", str(stories_path), *GREEDY_STORIES,
                       "--max-tokens", "40", "--stop", stop, STORY)
    assert rc == 0, err
    assert out == stories_greedy + "\n"
    assert "| length]" in err


# ------------------------------------------------------------------------ tokenize


TOKENIZE_TEXTS = [
    "Hello <|im_start|> world",
    "<s> hi </s>",
    "Once upon a time, there was a cat.\n  Tabs\tand  spaces",
    "héllo 日本 🙂",
]


@pytest.fixture(scope="module")
def llama_vocab(stories_path: Path, smollm_path: Path) -> dict[str, object]:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    # vocab_only: tokenizer tables only, no llama.cpp compute in this process
    return {name: llama_cpp.Llama(model_path=str(p), vocab_only=True, verbose=False)
            for name, p in (("stories", stories_path), ("smollm", smollm_path))}


@pytest.mark.parametrize("special", [False, True], ids=["plain", "special"])
@pytest.mark.parametrize("model", ["stories", "smollm"])
def test_tokenize_matches_llama_cpp(capsys: pytest.CaptureFixture[str],
                                    request: pytest.FixtureRequest,
                                    llama_vocab: dict[str, object], model: str,
                                    special: bool) -> None:
    path = request.getfixturevalue(f"{model}_path")
    ref = llama_vocab[model]
    for text in TOKENIZE_TEXTS:
        rc, out, err = cli(capsys, "tokenize", "-m", str(path), *(["--special"] if special else []),
                           text)
        assert rc == 0, err
        assert out.endswith("\n") and out.count("\n") == 1
        expected = ref.tokenize(text.encode(), add_bos=True, special=special)  # type: ignore
        assert [int(t) for t in out.split()] == expected, text


def test_tokenize_special_differs_on_smollm(capsys: pytest.CaptureFixture[str],
                                            smollm_path: Path) -> None:
    text = "Hello <|im_start|> world"
    _, plain, _ = cli(capsys, "tokenize", "-m", str(smollm_path), text)
    _, special, _ = cli(capsys, "tokenize", "-m", str(smollm_path), "--special", text)
    assert plain != special
    assert len(special.split()) < len(plain.split())


def test_tokenize_default_model(capsys: pytest.CaptureFixture[str], smollm_path: Path) -> None:
    assert cli(capsys, "tokenize", "Hi")[1] == cli(capsys, "tokenize", "-m", str(smollm_path),
                                                   "Hi")[1]


# ------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("command", ["generate", "tokenize"])
def test_missing_model_file(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                            command: str) -> None:
    missing = tmp_path / "nope.gguf"
    rc, out, err = cli(capsys, command, "--model", str(missing), "hello")
    assert rc == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("localllm: error: ")
    assert str(missing) in err


@pytest.mark.parametrize("content", [b"", b"hello, not a model\n", b"GGU"])
def test_non_gguf_file(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                       content: bytes) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    rc, out, err = cli(capsys, "generate", "--model", str(bad), "hello")
    assert rc == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("localllm: error: ")
    assert str(bad) in err and "GGUF" in err


def test_model_is_a_directory(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, out, err = cli(capsys, "generate", "--model", str(tmp_path), "hello")
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("localllm: error: ")


def test_missing_model_from_env_var_names_the_env_var(capsys: pytest.CaptureFixture[str],
                                                      tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(model_path.ENV_VAR, str(tmp_path / "gone.gguf"))
    rc, out, err = cli(capsys, "generate", "hello")
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and "gone.gguf" in err
    assert model_path.ENV_VAR in err


def test_prompt_longer_than_context(capsys: pytest.CaptureFixture[str],
                                    stories_path: Path) -> None:
    rc, out, err = cli(capsys, "generate", "-m", str(stories_path), "--max-model-len", "32",
                       "--temperature", "0", LONG_PROMPT)
    assert rc == 2
    assert out == ""
    line = the_error_line(err)
    assert "context holds 32" in line and "--max-model-len" in line


def test_max_model_len_past_the_models_context(capsys: pytest.CaptureFixture[str],
                                               caplog: pytest.LogCaptureFixture,
                                               stories_path: Path) -> None:
    # stories260K was trained on 2048 tokens: a longer --max-model-len is refused with a
    # warning, and a prompt over 2048 tokens is told it exceeds the model's whole context
    rc, out, err = cli(capsys, "generate", "-m", str(stories_path), "--max-model-len", "5000",
                       *SMALL_KV, "--temperature", "0", LONG_PROMPT * 30)
    assert rc == 2 and out == ""
    assert "max model length 5000 is more than the 2048 tokens this model was trained on; " \
        "serving 2048" in caplog.text
    line = the_error_line(err)
    assert "context holds 2048" in line and "the model's whole context" in line
    assert "--max-model-len" not in line


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--temperature", "-1"], "--temperature must be >= 0"),
        (["--temperature", "nan"], "--temperature must be a finite number, got nan"),
        (["--repeat-penalty", "inf"], "--repeat-penalty must be a finite number, got inf"),
        (["--max-tokens", "0"], "--max-tokens must be at least 1"),
        (["--stop", ""], "--stop strings must not be empty"),
    ],
)
def test_bad_sampling_options(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                              args: list[str], message: str) -> None:
    # named by the option, and refused before the model loads: the model is not even there
    rc, out, err = cli(capsys, "generate", "-m", str(tmp_path / "absent.gguf"), *args, STORY)
    assert rc == 2
    assert out == ""
    assert message in the_error_line(err)


def test_console_script_error_exit_code(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "localllm.apps.cli", "generate", "--model",
         str(tmp_path / "missing.gguf"), "hello"],
        capture_output=True, text=True, timeout=120, env=subprocess_env(tmp_path),
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("localllm: error: ") and "missing.gguf" in proc.stderr


# ------------------------------------------------------------------------ chat


def test_chat_piped_stdin(tmp_path: Path, smollm_path: Path) -> None:
    lines = [QUESTION, "/reset", "Hi", "/exit", "Tell me a long story."]  # the last: never read
    proc = subprocess.run(
        [console_script(), "chat", "--temperature", "0", "--max-tokens", "30", "--threads", "1",
         *SMALL_KV],
        input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=180,
        env=subprocess_env(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr
    replies = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert len(replies) >= 2, proc.stdout
    assert "Paris" in replies[0]
    stats = [ln for ln in proc.stderr.splitlines() if ln.startswith("[") and "tokens/s]" in ln]
    assert len(stats) == 2, proc.stderr  # two replies: /exit stopped before the last line
    assert "[conversation cleared]" in proc.stderr
    assert ">>>" not in proc.stdout  # no prompt-toolkit without a terminal


def test_chat_commands_in_process(capsys: pytest.CaptureFixture[str],
                                  monkeypatch: pytest.MonkeyPatch, stories_path: Path,
                                  tmp_path: Path) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("/help\n\n/system Be brief.\nHello\n"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))  # chat saves the conversation there
    rc, out, err = cli(capsys, "chat", "-m", str(stories_path), "--temperature", "0",
                       "--max-tokens", "8", "--dtype", "float32")
    assert rc == 0, err  # end of input ends the chat
    assert "/reset" in err and "/system TEXT" in err  # /help
    assert "[system prompt set; conversation cleared]" in err
    assert err.count("tokens/s]") == 1  # one reply: the empty line is skipped
    assert out.endswith("\n")


# ------------------------------------------------------------------------ Python API


def test_api_generate_batch(stories_path: Path) -> None:
    from localllm import LLM, SamplingParams

    llm = LLM(model=stories_path)
    params = SamplingParams(max_tokens=5, temperature=0)
    outs = llm.generate(["a", "b"], params)
    assert len(outs) == 2
    for o in outs:
        assert o.finish_reason == "length"
        assert len(o.token_ids) == 5
        assert o.error is None
    assert outs[0].prompt_token_ids == llm.encode("a")
    assert outs[1].prompt_token_ids == llm.encode("b")
    # batched results equal results of each prompt alone
    assert [o.token_ids for o in outs] == [llm.generate(p, params)[0].token_ids
                                           for p in ["a", "b"]]
    assert not llm.engine.has_unfinished()


def test_api_stream_and_stop(stories_path: Path) -> None:
    from localllm import LLM, SamplingParams

    llm = LLM(model=stories_path, dtype="float32")
    params = SamplingParams(max_tokens=40, temperature=0)
    full = llm.generate(STORY, params)[0]
    pieces = list(llm.stream(llm.encode(STORY), params))
    assert "".join(p.text for p in pieces) == full.text
    assert [t for p in pieces for t in p.token_ids] == full.token_ids
    assert pieces[-1].finished and pieces[-1].finish_reason == "length"

    stopped = llm.generate(STORY, SamplingParams(max_tokens=40, temperature=0,
                                                 stop=("play",)))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[:full.text.index("play")]

    # closing a stream early aborts its request
    stream = llm.stream(llm.encode(STORY), params)
    next(stream)
    stream.close()
    assert not llm.engine.has_unfinished()


def test_api_chat_default_model(smollm_path: Path) -> None:
    from localllm import LLM, CacheConfig, SamplingParams

    llm = LLM(cache=CacheConfig(memory_bytes=50 << 20))
    assert llm.path == smollm_path
    params = SamplingParams(max_tokens=30, temperature=0)
    [out] = llm.chat([{"role": "user", "content": QUESTION}], params)
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
    assert "<|im_end|>" not in out.text
    two = llm.chat([[{"role": "user", "content": QUESTION}],
                    [{"role": "system", "content": "You are helpful."},
                     {"role": "user", "content": "Hi"}]], params)
    assert len(two) == 2
    assert two[0].text == out.text
    assert all(o.finish_reason in ("stop", "length") and o.text for o in two)
