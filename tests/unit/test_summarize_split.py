"""Splitting on token counts and map-reduce, over a scripted client (one token per word), and
the command's exit status and rerun logic around a failing request."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from localllm.apps import summarize_run
from localllm.apps.cli import main
from localllm.apps.summarize_progress import Progress
from localllm.apps.summarize_split import Summarizer, pack
from localllm.client.base import Client, ClientError, Delta, Message, Usage
from localllm.config import SamplingParams
from localllm.model_card import ModelCard


async def words(text: str) -> int:
    return len(text.split())


class Scripted(Client):
    """Replies `sum<k>` and `reply_words - 1` more words (k: the request's number); fails any
    request that mentions FAIL-ME. Records every user message and reply, and the most
    requests in flight at once."""

    def __init__(self, context: int | None, reply_words: int = 1) -> None:
        self.card = ModelCard("scripted", "", None, "unknown", None, context, "in the test")
        self.reply_words = reply_words
        self.users: list[str] = []
        self.replies: list[str] = []
        self.in_flight = self.most_in_flight = 0

    def stream_chat(self, messages: Sequence[Message],
                    params: SamplingParams) -> AsyncIterator[Delta]:
        return self._reply(messages[-1]["content"])

    async def _reply(self, user: str) -> AsyncIterator[Delta]:
        self.users.append(user)
        reply = " ".join([f"sum{len(self.users)}"] + ["x"] * (self.reply_words - 1))
        self.replies.append(reply)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0.01)
            if "FAIL-ME" in user:
                raise ClientError("the server failed the request")
            yield Delta(reply, self.reply_words)
            yield Delta("", 0, "stop", Usage(len(user.split()), 1, 0))
        finally:
            self.in_flight -= 1

    def stream_text(self, prompt: str, params: SamplingParams) -> AsyncIterator[Delta]:
        raise NotImplementedError

    async def count_tokens(self, text: str) -> int:
        return len(text.split())

    async def aclose(self) -> None:
        pass


def test_pack_cuts_at_the_coarsest_boundary_that_fits() -> None:
    paras = [" ".join(f"p{i}w{j}" for j in range(6)) for i in range(5)]
    text = "\n\n".join(paras) + "\n"
    chunks = asyncio.run(pack(text, 13, words))
    assert "".join(chunks) == text
    assert all(len(c.split()) <= 13 for c in chunks)
    assert [len(c.split()) for c in chunks] == [12, 12, 6]  # two paragraphs a part
    assert all(c.rstrip().endswith("w5") for c in chunks)  # never inside a paragraph
    # one paragraph of 30 words in parts of 8: cut between words
    one = " ".join(f"w{j}" for j in range(30))
    chunks = asyncio.run(pack(one, 8, words))
    assert "".join(chunks) == one and [len(c.split()) for c in chunks] == [8, 8, 8, 6]


def test_pack_cuts_a_word_longer_than_the_budget_by_characters() -> None:
    async def chars(text: str) -> int:
        return len(text)

    blob = "x" * 100
    chunks = asyncio.run(pack(blob, 30, chars))
    assert "".join(chunks) == blob and all(len(c) <= 30 for c in chunks)


def test_map_reduce_splits_summarizes_parts_and_combines_them() -> None:
    # 12 paragraphs of 30 words, replies of 8 words: a part per paragraph, and 12 part
    # summaries need two rounds of combining
    client = Scripted(context=120, reply_words=8)
    params = SamplingParams(max_tokens=10, temperature=0)
    paras = [" ".join(f"p{i}w{j}" for j in range(30)) for i in range(12)]
    summarizer = Summarizer(client, "Summarize.", params, slots=3)
    budget = asyncio.run(summarizer.budget("long.txt"))
    assert budget is not None and 30 <= budget < 60
    summary = asyncio.run(summarizer.summarize("long.txt", "\n\n".join(paras)))
    assert summary.parts == 12 and summary.rounds == 2
    parts = [(u, r) for u, r in zip(client.users, client.replies) if "(part " in u]
    combines = [(u, r) for u, r in zip(client.users, client.replies)
                if "summaries of its consecutive parts" in u]
    assert [u.split("\n\n", 1)[1] for u, _ in parts] == [p + "\n\n" for p in paras[:-1]] + [
        paras[-1]]
    assert all("of 12)" in u for u, _ in parts)
    assert summary.requests == len(client.users) == 12 + len(combines)
    # round 1 combines the part summaries in order; the last request combines round 1's
    # replies into the summary
    final_user, final_reply = combines[-1]
    assert summary.text == final_reply == client.replies[-1]
    round1 = combines[:-1]
    assert len(round1) >= 2
    assert "\n\n".join(u.split("\n\n", 1)[1] for u, _ in round1) == "\n\n".join(
        r for _, r in parts)
    assert final_user.split("\n\n", 1)[1] == "\n\n".join(r for _, r in round1)
    assert client.most_in_flight == 3  # the parts ran at once, up to the slots
    assert all(len(u.split()) <= budget + 12 for u in client.users)


def test_short_text_is_one_request_and_tiny_context_is_refused() -> None:
    client = Scripted(context=4096)
    params = SamplingParams(max_tokens=10, temperature=0)
    summary = asyncio.run(Summarizer(client, "Summarize.", params, 2).summarize("a", "hi"))
    assert (summary.parts, summary.rounds, summary.requests) == (1, 0, 1)
    from localllm.errors import LocalLLMError

    with pytest.raises(LocalLLMError,
                       match=r"lower --max-words/--max-tokens \(or raise --max-model-len where"):
        asyncio.run(Summarizer(Scripted(40), "Summarize.", params, 2).budget("a"))


def test_failed_file_exits_1_and_a_rerun_retries_only_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
        ) -> None:
    clients: list[Scripted] = []

    async def fake_open(args: Any, load: Any) -> Client:
        clients.append(Scripted(4096))
        return clients[-1]

    monkeypatch.setattr(summarize_run, "open_client", fake_open)
    docs = tmp_path / "docs"
    docs.mkdir()
    for name in "abc":
        (docs / f"{name}.txt").write_text(f"text of {name}\n")
    (docs / "bad.txt").write_text("FAIL-ME please\n")
    out = tmp_path / "out"
    argv = ["summarize", str(docs), "--out", str(out), "--concurrency", "2"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f"localllm: failed {docs / 'bad.txt'}: the server failed the request" in err
    manifest = json.loads((out / "manifest.json").read_text())
    assert sorted(Path(e["input"]).name for e in manifest["files"]) == ["a.txt", "b.txt",
                                                                         "c.txt"]
    assert clients[0].most_in_flight == 2
    for e in manifest["files"]:
        md = (out / e["output"]).read_text()
        assert md.startswith(f"# {e['input']}\n\n") and "sum" in md
    # the rerun sends only the failed file again
    (docs / "bad.txt").write_text("fine now\n")
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "[3 unchanged since the last run, skipped]" in err
    assert len(clients[1].users) == 1 and "fine now" in clients[1].users[0]
    # other settings: everything again
    assert main([*argv, "--max-words", "5"]) == 0
    assert "unchanged since" not in capsys.readouterr().err and len(clients[2].users) == 4
    # bad usage: 2, with a one-line error
    assert main(["summarize", str(docs), "--concurrency", "0"]) == 2
    assert capsys.readouterr().err.strip() == (
        "localllm: error: --concurrency must be at least 1, got 0")


def test_stdout_keeps_input_order_and_json_is_one_document(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
        ) -> None:
    async def fake_open(args: Any, load: Any) -> Client:
        return Scripted(4096)

    monkeypatch.setattr(summarize_run, "open_client", fake_open)
    files = []
    for name in "abcd":
        files.append(tmp_path / f"{name}.txt")
        files[-1].write_text(f"{name} " * (40 if name == "a" else 1))
    assert main(["summarize", *map(str, files)]) == 0
    out = capsys.readouterr().out
    headers = [ln for ln in out.splitlines() if ln.startswith("## ")]
    assert headers == [f"## {f}" for f in files]
    assert main(["summarize", "--format", "json", *map(str, files)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [e["input"] for e in doc["files"]] == list(map(str, files))
    assert all(e["summary"].startswith("sum") for e in doc["files"])


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_on_a_terminal_and_lines_otherwise() -> None:
    term = _Terminal()
    bar = Progress(3, term)
    bar.say("localllm: skipped x: empty")
    for i in range(3):
        bar.finished(f"f{i}", "5 tokens, 0.1 s", output_tokens=5 * (i + 1))
    bar.close()
    shown = term.getvalue()
    assert "localllm: skipped x: empty\n" in shown
    assert "3/3 files [" in shown and "tokens/s]" in shown and "<" in shown
    assert "[1/3] f0" not in shown
    plain = io.StringIO()
    lines = Progress(2, plain)
    lines.finished("a.txt", "5 tokens, 0.1 s", 5)
    lines.failed("b.txt", "the server failed the request")
    assert plain.getvalue() == ("[1/2] a.txt: 5 tokens, 0.1 s\n"
                                "localllm: failed b.txt: the server failed the request\n")
