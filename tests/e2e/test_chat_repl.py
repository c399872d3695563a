"""The real `localllm chat` REPL in a pseudo-terminal, typed at as a person would (pexpect).

stories260K in fp32 with temperature 0: every reply shown must be the greedy reply the
Python API gives for the same conversation. Every user folder is a temporary one.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from chat_util import STORIES_ARGS, Repl, chat_env, saved

from localllm.config import SamplingParams
from localllm.llm import LLM, Message

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def llm(stories_path: Path, one_torch_thread: None) -> Iterator[LLM]:
    model = LLM(stories_path, dtype="float32")
    yield model
    model.close()


def greedy(llm: LLM, messages: list[Message], max_tokens: int = 20) -> str:
    return llm.chat(messages, SamplingParams(max_tokens=max_tokens, temperature=0))[0].text


def user(text: str) -> Message:
    return {"role": "user", "content": text}


def assistant(text: str) -> Message:
    return {"role": "assistant", "content": text}


def test_repl_replies_commands_and_resume(tmp_path: Path, stories_path: Path, llm: LLM) -> None:
    env = chat_env(tmp_path)
    args = ["-m", str(stories_path), *STORIES_ARGS, "--max-tokens", "20"]
    r = Repl(args, env)
    assert "localllm chat · stories260K · 293K llama" in r.banner
    assert "2,048-token context · cpu backend on cpu" in r.banner

    msgs: list[Message] = []
    for text in ["Hello", "first line\nsecond line"]:  # the second: Esc-Enter between lines
        shown, tokens = r.ask(text)
        msgs.append(user(text))
        expected = greedy(llm, msgs)
        assert shown == expected.strip("\n")
        assert tokens == len(llm.tokenizer.encode(expected, add_special=False)) or tokens == 20
        msgs.append(assistant(expected))
    assert saved(tmp_path)["messages"] == msgs  # saved after every reply

    r.p.send("/st\t")  # tab completion
    r.p.expect("ats")
    stats = r.command("")
    prompt_tokens = int(re.search(r"prompt tokens\s+(\d+)", stats).group(1))  # type: ignore
    cached = int(re.search(r"cached tokens\s+(\d+)", stats).group(1))  # type: ignore
    assert re.search(r"first token\s+0\.\d+ s", stats) and "tokens/s" in stats
    assert prompt_tokens == len(llm.encode_chat(msgs[:-1]))
    assert 0 < cached < prompt_tokens  # the first turn's blocks, from the in-memory cache

    # a \"\"\" block: Enter goes on to a new line until a line ends with \"\"\"
    r.p.send('"""\r')
    r.p.send("block one\r")
    r.send('block two"""')
    shown, _ = r.reply()
    msgs.append(user("block one\nblock two"))
    expected = greedy(llm, msgs)
    assert shown == expected.strip("\n")
    msgs.append(assistant(expected))

    shown, _ = r.ask("/retry")  # greedy: the same reply again, in place of the first
    assert shown == expected.strip("\n")
    assert saved(tmp_path)["messages"] == msgs

    shown = r.command("/set")
    assert re.search(r"temperature\s+0\.0\n", shown) and re.search(r"max_tokens\s+20\n", shown)
    assert "[temperature set]" in r.command("/set temperature 0.5")
    assert "top_k takes a whole number" in r.command("/set top_k many")
    r.command("/set max_tokens 5")
    shown = r.command("/set")
    assert re.search(r"temperature\s+0\.5\n", shown) and re.search(r"max_tokens\s+5\n", shown)
    r.command("/set temperature 0")
    shown, tokens = r.ask("Short")
    assert tokens <= 5 and shown == greedy(llm, [*msgs, user("Short")], 5).strip("\n")

    assert "[took back: 'Short']" in r.command("/undo")
    assert saved(tmp_path)["messages"] == msgs
    assert "conversation name '../x'" in r.command("/save ../x")  # refused, one line
    assert "[saved as story-1:" in r.command("/save story-1")
    assert "story-1" in r.command("/list")
    assert "[conversation cleared]" in r.command("/reset")
    assert "[no system prompt]" in r.command("/system")
    assert f"[loaded story-1: {len(msgs)} messages]" in r.command("/load story-1")
    assert "Esc-Enter" in r.command("/help") and "/retry" in r.command("/help")
    assert r.leave() == 0  # Ctrl-D
    assert "Hello" in (tmp_path / "state" / "localllm" / "chat_history").read_text()

    for resume in (["--resume", "story-1"], ["--resume"]):  # by name, and the newest
        r = Repl([*args, *resume], env)
        assert f"[resumed story-1: {len(msgs)} messages]" in r.banner
        shown, _ = r.ask("The end")
        assert shown == greedy(llm, [*msgs, user("The end")]).strip("\n")
        assert "[took back: 'The end']" in r.command("/undo")
        assert r.leave() == 0


def test_ctrl_c_stops_a_reply_and_keeps_it(tmp_path: Path, stories_path: Path, llm: LLM
                                           ) -> None:
    r = Repl(["-m", str(stories_path), *STORIES_ARGS, "--max-tokens", "1900"],
             chat_env(tmp_path))
    r.send("Tell me a story")
    r.p.expect(r"\w{3}")  # the reply is under way; 1,900 tokens take seconds
    time.sleep(0.3)
    r.p.sendintr()
    r.p.expect(re.escape("[stopped]"))
    after = r.prompt()
    tokens = int(re.search(r"\[(\d+) tokens", after).group(1))  # type: ignore[union-attr]
    assert 0 < tokens < 1900
    [question, partial] = saved(tmp_path)["messages"]
    assert question == user("Tell me a story")
    assert partial["interrupted"] is True
    longer = greedy(llm, [question], tokens + 8)  # the greedy reply goes on past the stop
    assert longer.startswith(partial["content"]) and len(partial["content"]) < len(longer)

    r.command("/set max_tokens 20")
    shown, _ = r.ask("Hi")  # the stopped request is gone: the next reply is as expected
    assert shown == greedy(llm, [question, assistant(partial["content"]), user("Hi")]
                           ).strip("\n")
    r.p.send("\x03")  # Ctrl-C at an empty prompt says how to leave; a second one leaves
    r.p.expect(re.escape("[Ctrl-C again, Ctrl-D or /exit leaves]"))
    assert r.leave("\x03") == 0
