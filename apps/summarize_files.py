"""What `localllm summarize` reads: files, folders (recursive) and `-` for stdin.

Folders are walked in sorted order. Hidden entries (names starting with a dot) are left out
unless `hidden`, and files a `.gitignore` excludes (git's rules through `pathspec`; a deeper
`.gitignore` overrides a shallower one) unless `gitignore=False`. `--include`/`--exclude`
take gitignore-style globs matched against the path inside the folder (`*.py` matches at any
depth, `src/*.py` only there). A symlink whose target lies outside the folder is skipped
unless `follow_symlinks`. Reading rejects binary, undecodable, unreadable and empty files
with a one-line reason (`Skipped`, `Unreadable`).
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import NamedTuple

import pathspec

from localllm.errors import LocalLLMError

STDIN = "-"
_SNIFF = 8192  # bytes looked at for a NUL byte


class Source(NamedTuple):
    name: str  # the path as the user reaches it, e.g. docs/intro.md; "<stdin>"
    path: Path | None  # None: stdin
    rel: PurePosixPath  # where its summary goes under --out (without the .md suffix)


class Skipped(NamedTuple):
    name: str
    reason: str


class Found(NamedTuple):
    sources: list[Source]
    skipped: list[Skipped]
    ignored: int  # paths left out: hidden, by .gitignore or by --include/--exclude


class Unreadable(Exception):
    """A file that is not summarized; the message is the one-line reason."""


def _globs(patterns: Sequence[str]) -> pathspec.PathSpec | None:
    return pathspec.GitIgnoreSpec.from_lines(patterns) if patterns else None


def _rel_name(path: str) -> PurePosixPath:
    """The output path of an input path: normalized, without its anchor or leading `..`."""
    parts = [p for p in PurePosixPath(os.path.normpath(path).replace(os.sep, "/")).parts
             if p not in ("/", "..", ".")]
    return PurePosixPath(*parts) if parts else PurePosixPath("input")


class _Walk:
    def __init__(self, root: Path, include: pathspec.PathSpec | None,
                 exclude: pathspec.PathSpec | None, follow: bool, gitignore: bool,
                 hidden: bool, skip_dirs: set[Path]) -> None:
        self.root, self.real_root = root, root.resolve()
        self.include, self.exclude, self.follow, self.gitignore = include, exclude, follow, \
            gitignore
        self.hidden, self.skip_dirs = hidden, skip_dirs
        self.sources: list[Source] = []
        self.skipped: list[Skipped] = []
        self.ignored = 0
        self._seen: set[Path] = set()

    def _ignores(self, specs: list[tuple[PurePosixPath, pathspec.GitIgnoreSpec]],
                 rel: PurePosixPath, is_dir: bool) -> bool:
        verdict = False
        for base, spec in specs:  # shallow to deep: the deepest verdict wins
            inner = str(rel.relative_to(base)) if base.parts else str(rel)
            result = spec.check_file(inner + "/" if is_dir else inner)
            if result.include is not None:
                verdict = result.include
        return verdict

    def run(self) -> None:
        self._dir(self.root, PurePosixPath(), [])

    def _dir(self, folder: Path, rel: PurePosixPath,
             specs: list[tuple[PurePosixPath, pathspec.GitIgnoreSpec]]) -> None:
        real = folder.resolve()
        if real in self._seen or real in self.skip_dirs:
            return
        self._seen.add(real)
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as e:
            self.skipped.append(Skipped(str(folder), f"unreadable folder ({e.strerror})"))
            return
        if self.gitignore:
            ignore_file = folder / ".gitignore"
            try:
                lines = ignore_file.read_text(errors="replace").splitlines()
                specs = [*specs, (rel, pathspec.GitIgnoreSpec.from_lines(lines))]
            except OSError:
                pass
        for entry in entries:
            self._entry(Path(entry.path), rel / entry.name, entry, specs)

    def _entry(self, path: Path, rel: PurePosixPath, entry: os.DirEntry[str],
               specs: list[tuple[PurePosixPath, pathspec.GitIgnoreSpec]]) -> None:
        name = str(path)
        if entry.name.startswith(".") and not self.hidden:
            self.ignored += 1
            return
        if entry.is_symlink():
            try:
                target = path.resolve(strict=True)
            except (OSError, RuntimeError) as e:
                reason = getattr(e, "strerror", None) or "a symlink loop"
                self.skipped.append(Skipped(name, f"unreadable: broken symlink ({reason})"))
                return
            if not self.follow and not target.is_relative_to(self.real_root):
                self.skipped.append(Skipped(name, f"symlink out of the folder (to {target}); "
                                                  f"--follow-symlinks follows it"))
                return
        try:
            is_dir = entry.is_dir()
            is_file = entry.is_file()
        except OSError as e:
            self.skipped.append(Skipped(name, f"unreadable ({e.strerror})"))
            return
        if (self.gitignore and self._ignores(specs, rel, is_dir)) or (
                self.exclude and self.exclude.match_file(str(rel) + ("/" if is_dir else ""))):
            self.ignored += 1
            return
        if is_dir:
            if entry.is_symlink() and not self.follow:
                return  # its target lies inside the folder: its files are walked there
            self._dir(path, rel, specs)
        elif not is_file:
            self.skipped.append(Skipped(name, "not a regular file"))
        elif self.include and not self.include.match_file(str(rel)):
            self.ignored += 1
        else:
            self.sources.append(Source(name, path, _rel_name(name)))


def discover(paths: Sequence[str], include: Sequence[str] = (), exclude: Sequence[str] = (),
             follow_symlinks: bool = False, gitignore: bool = True, hidden: bool = False,
             skip_dirs: Sequence[Path] = ()) -> Found:
    """The inputs named by `paths`, in order; a path that does not exist is a LocalLLMError.
    `skip_dirs`: folders never walked (the output folder)."""
    inc, exc = _globs(include), _globs(exclude)
    sources: list[Source] = []
    skipped: list[Skipped] = []
    ignored = 0
    if list(paths).count(STDIN) > 1:
        raise LocalLLMError("'-' (stdin) can be given only once")
    for raw in paths:
        if raw == STDIN:
            sources.append(Source("<stdin>", None, PurePosixPath("stdin")))
            continue
        path = Path(raw)
        if not path.exists() and not path.is_symlink():
            raise LocalLLMError(f"no such file or folder: {raw}")
        if path.is_dir():
            walk = _Walk(path, inc, exc, follow_symlinks, gitignore, hidden,
                         {d.resolve() for d in skip_dirs})
            walk.run()
            sources += walk.sources
            skipped += walk.skipped
            ignored += walk.ignored
        else:  # a file named on the command line is read whatever the globs say
            sources.append(Source(raw, path, _rel_name(raw)))
    return Found(_unique(sources), skipped, ignored)


def _unique(sources: list[Source]) -> list[Source]:
    """Each input once (by real path), each with its own output path."""
    seen: set[str] = set()
    taken: set[PurePosixPath] = set()
    out = []
    for s in sources:
        key = str(s.path.resolve()) if s.path is not None else STDIN
        if key in seen:
            continue
        seen.add(key)
        rel, n = s.rel, 1
        while rel in taken:
            n += 1
            rel = s.rel.with_name(f"{s.rel.name}~{n}")
        taken.add(rel)
        out.append(s._replace(rel=rel))
    return out


def read_source(source: Source) -> bytes:
    """The raw bytes of an input; Unreadable when the file cannot be read."""
    if source.path is None:
        return sys.stdin.buffer.read()
    try:
        mode = os.stat(source.path).st_mode
        if stat.S_ISDIR(mode):
            raise Unreadable("a folder")
        with open(source.path, "rb") as f:
            return f.read()
    except OSError as e:
        raise Unreadable(f"unreadable ({e.strerror})") from None


def decode(data: bytes) -> str:
    """The text of a file's bytes; Unreadable for empty, binary and undecodable data."""
    if not data.strip():
        return _fail("empty" if not data else "empty (only whitespace)")
    nul = data.find(b"\0", 0, _SNIFF)
    if nul >= 0:
        return _fail(f"binary (a NUL byte at offset {nul})")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        return _fail(f"not UTF-8 text (undecodable byte at offset {e.start})")


def _fail(reason: str) -> str:
    raise Unreadable(reason)

