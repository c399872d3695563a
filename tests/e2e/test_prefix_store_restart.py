"""The on-disk prefix cache across real restarts: `localllm generate`, `localllm chat` and
`localllm serve` run as new processes prefill only what the store does not hold and answer the
same; on the default model a stored 2,000-token prompt answers at least 10x sooner than cold."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from serve_util import ServeProcess

from localllm import LLM, CacheConfig, model_path

ROOT = Path(__file__).resolve().parents[2]
APACHE = ROOT / "benchmarks" / "data" / "apache-2.0.txt"
STORY = ("Once upon a time there was a little girl named Lily. She loved to play outside in the "
         "park with her friends. One day she found a big red ball under a tree. ")


def env(tmp_path: Path) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k != model_path.ENV_VAR}
    e.update(XDG_CONFIG_HOME=str(tmp_path), XDG_STATE_HOME=str(tmp_path), OMP_NUM_THREADS="1")
    return e


def localllm(tmp_path: Path, *args: str, stdin: str | None = None
             ) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "localllm.apps.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=300, env=env(tmp_path))
    assert proc.returncode == 0, proc.stderr
    return proc


def summary(err: str) -> tuple[int, int, float]:
    """(prompt tokens, cached tokens, seconds to the first token) of `generate`'s stderr."""
    m = re.search(r"prompt (\d+) tokens \((\d+) cached\), first token ([\d.]+) s", err)
    assert m, err
    return int(m.group(1)), int(m.group(2)), float(m.group(3))


def test_generate_in_a_new_process_prefills_only_the_tail(tmp_path: Path,
                                                          stories_path: Path) -> None:
    store = tmp_path / "store"
    args = ("generate", "--model", str(stories_path), "--dtype", "float32", "--temperature",
            "0", "--max-tokens", "24", "--prefix-cache-dir", str(store), STORY * 4)
    cold = localllm(tmp_path, *args)
    warm = localllm(tmp_path, *args)
    n, cached, _ = summary(cold.stderr)
    assert cached == 0 and n > 100
    assert summary(warm.stderr)[1] == (n - 1) // 16 * 16
    assert warm.stdout == cold.stdout  # fp32: the same token ids, so the same text
    longer = localllm(tmp_path, *args[:-1], STORY * 4 + "The ball was")
    assert summary(longer.stderr)[1] == (n - 1) // 16 * 16  # the shared part only


def test_chat_resumed_in_a_new_process_reuses_the_conversation(tmp_path: Path,
                                                               stories_path: Path) -> None:
    store = tmp_path / "store"
    args = ("-v", "chat", "--model", str(stories_path), "--dtype", "float32", "--temperature",
            "0", "--max-tokens", "20", "--threads", "1", "--prefix-cache-dir", str(store),
            "--system", STORY * 3)
    first = localllm(tmp_path, *args, stdin="Where was the ball?\nWhat color was it?\n")
    again = localllm(tmp_path, *args, stdin="Where was the ball?\nWhat color was it?\nAnd?\n")
    assert again.stdout.splitlines()[:2] == first.stdout.splitlines()[:2]
    loads = [tuple(map(int, m)) for m in
             re.findall(r"prefix cache: (\d+) tokens from disk, (\d+) from memory", again.stderr)]
    assert len(loads) == 3, again.stderr
    assert loads[0][0] >= 3 * len(STORY) // 8  # the system prompt, stored by the first process
    # the second turn: the first turn and its reply, also written by the first process
    assert loads[1][0] > 0 and sum(loads[1]) > sum(loads[0])
    assert loads[2][1] > sum(loads[1])  # the third turn: what this process computed itself


def test_serve_restarted_between_two_requests_reuses_the_system_prompt(
        tmp_path: Path, stories_path: Path) -> None:
    system = {"role": "system", "content": STORY * 3}

    def ask(question: str, *store: str) -> tuple[str, float, float]:
        """(reply, prompt tokens looked up, found) of one request to a fresh server."""
        server = ServeProcess.start(["--model", str(stories_path), "--dtype", "float32",
                                     "--threads", "1", "--shutdown-timeout", "1", *store],
                                    tmp_path / "s.sock", env(tmp_path))
        try:
            with server.http() as c:
                r = c.post("/v1/chat/completions", json={
                    "messages": [system, {"role": "user", "content": question}],
                    "max_tokens": 16, "temperature": 0})
                assert r.status_code == 200, r.text
            m = server.metrics()
        finally:
            assert server.stop() == 0, server.output
        return (r.json()["choices"][0]["message"]["content"],
                m["localllm_prefix_cache_queries_tokens_total"],
                m["localllm_prefix_cache_hits_tokens_total"])

    store = ("--prefix-cache-dir", str(tmp_path / "store"))
    _, _, hits = ask("Where was the ball?", *store)
    assert hits == 0
    reply, asked, hits = ask("What color was it?", *store)  # a restart, another question
    llm = LLM(stories_path, dtype="float32", cache=CacheConfig(num_blocks=8, prefix_cache=False))
    first, second = (llm.encode_chat([system, {"role": "user", "content": q}])
                     for q in ("Where was the ball?", "What color was it?"))
    common = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert asked == len(second) and hits == common // 16 * 16 > 100  # the shared full blocks
    assert reply == ask("What color was it?", "--no-prefix-cache")[0]


@pytest.mark.slow
def test_default_model_stored_prompt_answers_10x_sooner(tmp_path: Path,
                                                        smollm_path: Path) -> None:
    text = APACHE.read_text()[:10290]  # 2,000 tokens of the default model
    args = ("generate", "--model", str(smollm_path), "--temperature", "0", "--max-tokens", "1",
            "--threads", "1", "--kv-cache-memory", "0.1", "--prefix-cache-dir",
            str(tmp_path / "store"), text)
    cold = localllm(tmp_path, *args)
    warm = localllm(tmp_path, *args)
    n, _, cold_ttft = summary(cold.stderr)
    assert n == 2000
    _, cached, warm_ttft = summary(warm.stderr)
    assert cached == 1984 and warm.stdout == cold.stdout
    assert cold_ttft >= 10 * warm_ttft, (cold_ttft, warm_ttft)
