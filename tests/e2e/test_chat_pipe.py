"""`localllm chat` without a terminal: piped messages, `--endpoint` against a live `serve`, the
context guard (local and remote), and a resumed conversation answered from the prefix cache
on disk. stories260K in fp32, temperature 0: replies are compared with the Python API's."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from chat_util import STATS, STORIES_ARGS, chat_env, pipe_chat, saved
from serve_util import KEY, ServeProcess

from localllm.apps.cli import main
from localllm.config import SamplingParams
from localllm.llm import LLM, Message

pytestmark = pytest.mark.usefixtures("one_torch_thread")
LINE = "The cat sat on the mat and looked at the little dog."


@pytest.fixture(scope="module")
def llm(stories_path: Path, one_torch_thread: None) -> Iterator[LLM]:
    model = LLM(stories_path, dtype="float32")
    yield model
    model.close()


def conversation_replies(llm: LLM, texts: list[str], max_tokens: int = 20,
                         system: str | None = None) -> list[str]:
    """The greedy reply to each message of one conversation."""
    msgs: list[Message] = [{"role": "system", "content": system}] if system else []
    replies = []
    for text in texts:
        msgs.append({"role": "user", "content": text})
        params = SamplingParams(max_tokens=max_tokens, temperature=0)
        replies.append(llm.chat(msgs, params)[0].text)
        msgs.append({"role": "assistant", "content": replies[-1]})
    return replies


def stats_table(err: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"(prompt|cached) tokens\s+(\d+)", err)}


def test_piped_messages_print_only_the_replies(tmp_path: Path, stories_path: Path, llm: LLM
                                               ) -> None:
    stdin = f'Hello\n/set max_tokens 12\n"""\n{LINE}\nThe end.\n"""\n\nBye\n'
    proc = pipe_chat(["-m", str(stories_path), *STORIES_ARGS, "--max-tokens", "20"], stdin,
                     chat_env(tmp_path))
    assert proc.returncode == 0, proc.stderr
    first = conversation_replies(llm, ["Hello"])[0]
    msgs: list[Message] = [{"role": "user", "content": "Hello"},
                           {"role": "assistant", "content": first}]
    rest = []
    for text in [f"{LINE}\nThe end.", "Bye"]:
        msgs.append({"role": "user", "content": text})
        rest.append(llm.chat(msgs, SamplingParams(max_tokens=12, temperature=0))[0].text)
        msgs.append({"role": "assistant", "content": rest[-1]})
    assert proc.stdout == "".join(r + "\n" for r in [first, *rest])  # nothing else
    assert len(STATS.findall(proc.stderr)) == 3
    assert "localllm chat ·" not in proc.stderr  # the banner is for terminals
    assert saved(tmp_path)["messages"] == msgs


def test_endpoint_socket_and_tcp_give_the_local_replies(tmp_path: Path, llm: LLM,
                                                        stories_server: ServeProcess) -> None:
    texts = ["Hello", LINE]
    replies = conversation_replies(llm, texts)
    expected = "".join(r + "\n" for r in replies)
    args = [*STORIES_ARGS, "--max-tokens", "20"]
    sock = pipe_chat([*args, "--endpoint", f"unix:{stories_server.socket}"],
                     "\n".join(texts) + "\n/stats\n", chat_env(tmp_path))
    assert sock.returncode == 0, sock.stderr
    assert sock.stdout == expected
    last_prompt = llm.encode_chat([{"role": "user", "content": "Hello"},
                                   {"role": "assistant", "content": replies[0]},
                                   {"role": "user", "content": LINE}])
    assert stats_table(sock.stderr)["prompt"] == len(last_prompt)  # the server's usage
    assert saved(tmp_path)["model"] == "stories260K"
    tcp = pipe_chat([*args, "--endpoint", f"http://127.0.0.1:{stories_server.port}",
                     "--no-save"], "\n".join(texts) + "\n",
                    chat_env(tmp_path, LOCALLLM_API_KEY=KEY))
    assert tcp.returncode == 0, tcp.stderr
    assert tcp.stdout == expected
    bad = pipe_chat([*args, "--endpoint", f"http://127.0.0.1:{stories_server.port}",
                     "--api-key", "wrong"], "Hello\n", chat_env(tmp_path))
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("localllm: error: ") and bad.stderr.count("\n") == 1


def test_endpoint_with_the_default_models_chat_template(tmp_path: Path,
                                                       smollm_server: ServeProcess) -> None:
    proc = pipe_chat(["--temperature", "0", "--max-tokens", "30", "--endpoint",
                      f"unix:{smollm_server.socket}", "--model", "smollm"],
                     "What is the capital of France?\n", chat_env(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout and len(STATS.findall(proc.stderr)) == 1


def test_resume_of_a_missing_conversation_is_one_line(
        tmp_path: Path, stories_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    for name, value in chat_env(tmp_path).items():
        if name.startswith("XDG_"):
            monkeypatch.setenv(name, value)
    for resume in (["--resume", "nope"], ["--resume"], ["--resume", "../x"]):
        assert main(["chat", "-m", str(stories_path), *resume]) == 2  # before loading
        out, err = capsys.readouterr()
        assert out == "" and err.startswith("localllm: error: ") and err.count("\n") == 1


def _guard_checks(proc_err: str, proc_out: str, rc: int) -> None:
    assert rc == 0, proc_err
    assert "[context full (" in proc_err and "the system prompt is kept" in proc_err
    assert "Traceback" not in proc_err
    assert len(proc_out.splitlines()) >= 3


def test_context_guard_local(tmp_path: Path, stories_path: Path) -> None:
    too_long = " ".join([LINE] * 12)
    stdin = f"{LINE}\n{LINE}\n{too_long}\n{LINE}\n"
    proc = pipe_chat(["-m", str(stories_path), *STORIES_ARGS, "--max-tokens", "40",
                      "--max-model-len", "128", "--system", "Be kind."], stdin,
                     chat_env(tmp_path))
    _guard_checks(proc.stderr, proc.stdout, proc.returncode)
    assert re.search(r"\[the message alone is \d+ tokens; the context holds 128; the "
                     r"message was not kept\]", proc.stderr)
    assert len(STATS.findall(proc.stderr)) == 3  # three replies, none to the long message
    conv = saved(tmp_path)
    assert conv["system"] == "Be kind." and len(conv["messages"]) == 6
    assert conv["start"] > 0  # the oldest turns are left out of the prompt, not lost


def test_context_guard_remote(tmp_path: Path, stories_path: Path) -> None:
    server = ServeProcess.start(["--model", str(stories_path), "--dtype", "float32",
                                 "--threads", "1", "--max-model-len", "128",
                                 "--kv-cache-memory", "0.05"], tmp_path / "s.sock")
    try:
        proc = pipe_chat([*STORIES_ARGS, "--max-tokens", "40", "--endpoint",
                          f"unix:{server.socket}"], f"{LINE}\n{LINE}\n{LINE}\n",
                         chat_env(tmp_path))
    finally:
        server.stop()
    _guard_checks(proc.stderr, proc.stdout, proc.returncode)


def test_resumed_conversation_comes_from_the_prefix_cache(tmp_path: Path, stories_path: Path
                                                          ) -> None:
    system = " ".join(["The little dog ran to the park and played with a red ball."] * 20)
    args = ["-m", str(stories_path), *STORIES_ARGS, "--max-tokens", "40"]
    env = chat_env(tmp_path, LOCALLLM_PREFIX_CACHE="1",
                   LOCALLLM_PREFIX_CACHE_DIR=str(tmp_path / "prefix"))
    first = pipe_chat([*args, "--system", system],
                      "Tell me about the dog.\nWhat did he do next?\n/stats\n", env)
    assert first.returncode == 0, first.stderr
    before = stats_table(first.stderr)["prompt"]  # the last prompt of the first run
    assert before > 500

    # without the store, the first message after --resume prefills the whole history
    cold = pipe_chat([*args, "--resume", "--no-save"], "And then?\n/stats\n",
                     {**env, "LOCALLLM_PREFIX_CACHE": "0"})
    assert cold.returncode == 0, cold.stderr
    resumed = pipe_chat([*args, "--resume"], "And then?\n/stats\n", env)
    assert resumed.returncode == 0, resumed.stderr
    after = stats_table(resumed.stderr)
    assert after["prompt"] > before
    assert after["cached"] >= before // 16 * 16  # every full block of the history
    assert stats_table(cold.stderr) == {"prompt": after["prompt"], "cached": 0}
    assert cold.stdout == resumed.stdout
