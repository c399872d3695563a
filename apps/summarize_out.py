"""Where `localllm summarize` puts its summaries, and what a rerun may skip.

`--out DIR --format md`: one `DIR/<input path>.md` per input (the input's path mirrored under
DIR) beside `DIR/manifest.json`. `--format json`: everything in `DIR/summaries.json`, which is
its own manifest. A manifest entry: input path, SHA-256 of its bytes and of the settings (model,
sampling, instruction), output path, parts, tokens, seconds. Every file is written to a
temporary name and renamed, and the manifest is rewritten as each input finishes, so an
interrupted run keeps all it finished.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from localllm.apps.summarize_files import Source
from localllm.apps.summarize_split import Summary
from localllm.errors import LocalLLMError

MANIFEST = "manifest.json"
JSON_FILE = "summaries.json"
VERSION = 1


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def settings_hash(settings: dict[str, Any]) -> str:
    return sha256(json.dumps(settings, sort_keys=True, default=str).encode())


def _umask() -> int:
    """The process's umask, read without setting it (`os.umask` would, for every thread)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return 0o022


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename; the file gets the mode
    a plain `open` would give it (mkstemp's temporary file is 0600)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), 0o666 & ~_umask())
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def entry(source: Source, content: str, settings: str, summary: Summary,
          seconds: float) -> dict[str, Any]:
    return {"input": source.name, "content_sha256": content, "settings_sha256": settings,
            "output": f"{source.rel}.md", "parts": summary.parts,
            "combine_rounds": summary.rounds, "requests": summary.requests,
            "prompt_tokens": summary.prompt_tokens, "output_tokens": summary.output_tokens,
            "seconds": round(seconds, 3)}


def markdown(source: Source, summary: str) -> str:
    return f"# {source.name}\n\n{summary}\n"


class OutDir:
    """The --out folder: its manifest (loaded once, kept here) and the summaries."""

    def __init__(self, root: Path, fmt: str) -> None:
        if root.exists() and not root.is_dir():
            raise LocalLLMError(f"--out {root}: is a file; give a folder")
        self.root, self.fmt = root, fmt
        self.manifest = root / (JSON_FILE if fmt == "json" else MANIFEST)
        self.entries: dict[str, dict[str, Any]] = {}
        if self.manifest.is_file():
            try:
                data = json.loads(self.manifest.read_text(encoding="utf-8"))
                self.entries = {e["input"]: e for e in data["files"]}
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise LocalLLMError(f"{self.manifest} is not a summarize manifest ({e}); "
                                    f"move it away or pick another --out") from None

    def unchanged(self, source: Source, content: str, settings: str) -> bool:
        """True when the last run summarized these bytes with these settings (and its
        output is still there)."""
        e = self.entries.get(source.name)
        if e is None:
            return False
        if (e.get("content_sha256"), e.get("settings_sha256")) != (content, settings):
            return False
        return self.fmt == "json" or (self.root / e["output"]).is_file()

    def save(self, source: Source, record: dict[str, Any], summary: str) -> None:
        if self.fmt == "json":
            record = {**record, "output": str(self.manifest.name), "summary": summary}
        else:
            write_atomic(self.root / record["output"], markdown(source, summary))
        self.entries[source.name] = record
        body = {"version": VERSION, "files": list(self.entries.values())}
        write_atomic(self.manifest, json.dumps(body, indent=1, ensure_ascii=False) + "\n")
