"""`localllm summarize` on the default model, as a person runs it: a folder with a file longer
than the context (map-reduce), files it must skip, a rerun, --follow-symlinks, stdin, exit
codes through the console script, Ctrl-C, and --endpoint against a live `serve`.

The unreadable file is a symlink loop (open fails with ELOOP, for root too; chmod 000 is
tested in tests/unit/test_summarize_files.py where the tests do not run as root).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from serve_util import ServeProcess, interruptible
from test_cli import cli, console_script, subprocess_env

from localllm import model_path
from localllm.config import CacheConfig, SamplingParams
from localllm.llm import LLM

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ENGINE = ["--kv-cache-memory", "0.05", "--threads", "1", "--max-words", "8"]
TOPICS = ["apples grow on trees in the orchard", "the river runs to the sea",
          "bees make honey in the hive", "trains cross the mountains at night",
          "the library lends books to children", "snow covers the town in winter"]


def _long_text() -> str:
    """Six paragraphs of about 60 tokens: several parts in a 256-token context."""
    return "\n\n".join(" ".join(f"Sentence {j} says that {t}." for j in range(5))
                       for t in TOPICS) + "\n"


@pytest.fixture(autouse=True)
def no_user_model_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(model_path.ENV_VAR, raising=False)
    monkeypatch.setattr(model_path, "config_file", lambda: tmp_path / "no-config.toml")


@pytest.fixture()
def docs(tmp_path: Path, smollm_path: Path) -> Path:
    docs = tmp_path / "docs"
    (docs / "src").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "notes.txt").write_text("Notes from outside the folder.\n")
    (docs / "long.txt").write_text(_long_text())
    (docs / "short.md").write_text("# Cats\n\nCats sleep a lot and like warm places.\n")
    (docs / "src" / "add.py").write_text("def add(a, b):\n    return a + b\n")
    (docs / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    (docs / "empty.txt").write_bytes(b"")
    (docs / "loop.txt").symlink_to("loop.txt")
    (docs / "outside.txt").symlink_to(tmp_path / "elsewhere" / "notes.txt")
    return docs


def test_folder_map_reduce_skips_and_reruns(capsys: pytest.CaptureFixture[str], docs: Path,
                                            tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["summarize", str(docs), "--out", str(out), "--max-model-len", "256", *ENGINE]
    rc, stdout, err = cli(capsys, *args)
    assert rc == 0, err
    assert stdout == ""
    assert f"localllm: skipped {docs / 'image.png'}: binary (a NUL byte at offset 8)" in err
    assert f"localllm: skipped {docs / 'empty.txt'}: empty" in err
    assert f"localllm: skipped {docs / 'loop.txt'}: unreadable: broken symlink" in err
    assert f"localllm: skipped {docs / 'outside.txt'}: symlink out of the folder" in err
    manifest = json.loads((out / "manifest.json").read_text())
    entries = {Path(e["input"]).name: e for e in manifest["files"]}
    assert sorted(entries) == ["add.py", "long.txt", "short.md"]
    long = entries["long.txt"]
    assert long["parts"] >= 2 and long["combine_rounds"] >= 1
    assert long["requests"] > long["parts"]  # parts, then at least one combining request
    assert f"{long['parts']} parts combined in {long['combine_rounds']} rounds" in err
    for e in entries.values():
        md = (out / e["output"]).read_text()
        assert md.startswith(f"# {e['input']}\n\n") and len(md.split("\n\n", 1)[1].strip())
        assert e["output"].endswith(".md") and e["output_tokens"] > 0
    assert not list(out.rglob("*.tmp"))

    # nothing changed: everything is skipped
    rc, _, err = cli(capsys, *args)
    assert rc == 0 and "[3 unchanged since the last run, skipped]" in err
    assert "summarized 0 of 0 files" in err
    # the symlink out of the folder is read with --follow-symlinks, and a changed file again
    (docs / "short.md").write_text("# Dogs\n\nDogs bark at the mail carrier.\n")
    rc, _, err = cli(capsys, *args, "--follow-symlinks")
    assert rc == 0 and "[2 unchanged since the last run, skipped]" in err
    assert "summarized 2 of 2 files" in err and "symlink out of the folder" not in err
    assert "outside.txt" in (out / "manifest.json").read_text()


def test_stdout_stdin_and_json(capsys: pytest.CaptureFixture[str], docs: Path,
                               smollm_path: Path, tmp_path: Path) -> None:
    short = docs / "short.md"
    rc, out, err = cli(capsys, "summarize", str(short), *ENGINE)
    assert rc == 0, err
    header, body = out.split("\n\n", 1)
    assert header == f"## {short}"
    # the summary is the greedy chat reply to the system prompt and the file
    llm = LLM(smollm_path, cache=CacheConfig(memory_bytes=50 << 20), num_threads=1)
    messages = [{"role": "system", "content": "You write summaries. Summarize the text the "
                 "user sends in at most 8 words. Reply with the summary only."},
                {"role": "user", "content": f"File: {short}\n\n{short.read_text()}"}]
    expected = llm.chat(messages, SamplingParams(max_tokens=32, temperature=0))[0].text
    llm.close()
    assert body == expected.strip() + "\n\n"
    # stdin, through the console script: exit codes reach the shell, stdout has summaries only
    env = subprocess_env(tmp_path)
    run = subprocess.run([console_script(), "summarize", "-", "--format", "json", *ENGINE],
                         input="Bees make honey in the hive.\n", capture_output=True,
                         text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    (entry,) = json.loads(run.stdout)["files"]
    assert entry["input"] == "<stdin>" and entry["summary"] and entry["parts"] == 1
    bad = subprocess.run([console_script(), "summarize", str(tmp_path / "nope"), *ENGINE],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.strip() == f"localllm: error: no such file or folder: {tmp_path / 'nope'}"
    usage = subprocess.run([console_script(), "summarize", "--format", "xml", str(short)],
                           capture_output=True, text=True, env=env, timeout=120)
    assert usage.returncode == 2 and "invalid choice: 'xml'" in usage.stderr


def test_context_too_small_is_bad_usage(capsys: pytest.CaptureFixture[str], docs: Path
                                        ) -> None:
    rc, _, err = cli(capsys, "summarize", str(docs / "short.md"), "--max-model-len", "96",
                     *ENGINE)
    assert rc == 2
    line = err.strip().splitlines()[-1]
    assert "lower --max-words/--max-tokens (or raise --max-model-len" in line


def test_ctrl_c_keeps_finished_files_and_says_how_to_continue(tmp_path: Path,
                                                              smollm_path: Path) -> None:
    many = tmp_path / "many"
    many.mkdir()
    for i in range(20):
        (many / f"f{i:02}.txt").write_text(f"File {i} is about a dog named Rex {i}.\n")
    out = tmp_path / "out"
    cmd = [console_script(), "summarize", str(many), "--out", str(out), "--concurrency", "1",
           *ENGINE]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=subprocess_env(tmp_path), preexec_fn=interruptible)
    deadline = time.monotonic() + 120
    while not (out / "manifest.json").exists() and proc.poll() is None:
        assert time.monotonic() < deadline, "no summary after 120 s"
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    kept = json.loads((out / "manifest.json").read_text())["files"]
    assert 1 <= len(kept) < 20
    assert f"interrupted after {len(kept)} of 20 files; finished summaries are kept in " \
           f"{out}; run the same command again" in err
    assert all((out / e["output"]).is_file() for e in kept)
    assert not list(out.rglob("*.tmp"))
    again = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(tmp_path),
                           timeout=300)
    assert again.returncode == 0, again.stderr
    assert f"[{len(kept)} unchanged since the last run, skipped]" in again.stderr
    assert len(json.loads((out / "manifest.json").read_text())["files"]) == 20


def test_endpoint_of_a_live_server(capsys: pytest.CaptureFixture[str], docs: Path,
                                   smollm_server: ServeProcess, tmp_path: Path) -> None:
    """The same folder through `serve`'s socket: the long file is split on the server's
    context (2048) with its /tokenize counts, and short files read as locally."""
    (docs / "long.txt").write_text(_long_text() * 8)  # about 2,900 tokens
    out = tmp_path / "remote"
    rc, _, err = cli(capsys, "summarize", str(docs), "--out", str(out),
                     "--endpoint", f"unix:{smollm_server.socket}", "--max-words", "8")
    assert rc == 0, err
    assert "served at unix:" in err
    entries = {Path(e["input"]).name: e for e in
               json.loads((out / "manifest.json").read_text())["files"]}
    assert sorted(entries) == ["add.py", "long.txt", "short.md"]
    assert entries["long.txt"]["parts"] >= 2
    local = tmp_path / "local"
    rc, _, err = cli(capsys, "summarize", str(docs / "short.md"), "--out", str(local),
                     "--max-model-len", "2048", *ENGINE)
    assert rc == 0, err
    remote_md = (out / entries["short.md"]["output"]).read_text()
    (local_entry,) = json.loads((local / "manifest.json").read_text())["files"]
    assert (local / local_entry["output"]).read_text() == remote_md
    assert local_entry["settings_sha256"] != entries["short.md"]["settings_sha256"]
    # a wrong key over TCP is a one-line error, exit 2
    rc, _, err = cli(capsys, "summarize", str(docs / "short.md"), "--endpoint",
                     f"http://127.0.0.1:{smollm_server.port}", "--api-key", "wrong")
    assert rc == 2 and err.strip().startswith("localllm: error: ")
    assert len([ln for ln in err.splitlines() if ln.startswith("localllm: error")]) == 1
