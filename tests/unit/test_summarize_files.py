"""What `localllm summarize` reads from a folder: every kind of entry that must be skipped
(with its one-line reason), .gitignore rules, hidden entries, globs and the symlink guard."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from localllm.apps.summarize_files import Unreadable, decode, discover, read_source
from localllm.errors import LocalLLMError


def _tree(root: Path) -> Path:
    docs = root / "docs"
    (docs / "sub").mkdir(parents=True)
    (root / "outside").mkdir()
    (root / "outside" / "secret.txt").write_text("outside the folder\n")
    (docs / "a.txt").write_text("plain text\n")
    (docs / "sub" / "b.py").write_text("def f():\n    return 1\n")
    (docs / "bin.dat").write_bytes(b"\x7fELF\x00\x01\x02")
    (docs / "empty.txt").write_bytes(b"")
    (docs / "blank.txt").write_text("  \n\n")
    (docs / "latin1.txt").write_bytes("café\n".encode("latin-1"))
    (docs / "loop").symlink_to("loop")  # ELOOP: unreadable for root too
    (docs / "dangling").symlink_to("gone.txt")
    (docs / "out-link").symlink_to(root / "outside" / "secret.txt")
    (docs / "in-link.txt").symlink_to("a.txt")
    os.mkfifo(docs / "fifo")
    (docs / ".hidden.txt").write_text("hidden\n")
    (docs / ".gitignore").write_text("*.log\nbuild/\n")
    (docs / "x.log").write_text("log\n")
    (docs / "build").mkdir()
    (docs / "build" / "gen.txt").write_text("generated\n")
    (docs / "sub" / ".gitignore").write_text("!keep.log\n")
    (docs / "sub" / "keep.log").write_text("kept by a deeper rule\n")
    return docs


def _read_all(found: object) -> tuple[list[str], dict[str, str]]:
    """(names read as text, {name: reason} of those skipped) after reading every source."""
    names, reasons = [], {}
    for s in found.skipped:  # type: ignore[attr-defined]
        reasons[Path(s.name).name] = s.reason
    for src in found.sources:  # type: ignore[attr-defined]
        try:
            decode(read_source(src))
            names.append(Path(src.name).name)
        except Unreadable as e:
            reasons[Path(src.name).name] = str(e)
    return names, reasons


def test_a_folder_with_every_kind_of_entry(tmp_path: Path) -> None:
    docs = _tree(tmp_path)
    found = discover([str(docs)])
    names, reasons = _read_all(found)
    # in-link.txt is a.txt again (read once); keep.log is re-included by sub/.gitignore
    assert names == ["a.txt", "b.py", "keep.log"]
    assert reasons["bin.dat"] == "binary (a NUL byte at offset 4)"
    assert reasons["empty.txt"] == "empty"
    assert reasons["blank.txt"] == "empty (only whitespace)"
    assert reasons["latin1.txt"] == "not UTF-8 text (undecodable byte at offset 3)"
    assert reasons["loop"].startswith("unreadable: broken symlink")
    assert reasons["dangling"] == "unreadable: broken symlink (No such file or directory)"
    assert reasons["out-link"].startswith("symlink out of the folder (to ")
    assert "--follow-symlinks" in reasons["out-link"]
    assert reasons["fifo"] == "not a regular file"
    # .hidden.txt, .gitignore, sub/.gitignore, x.log, build/
    assert found.ignored == 5
    assert all("\n" not in r for r in reasons.values())
    # outputs mirror the paths under the folder's name
    assert {str(s.rel) for s in found.sources} >= {f"{docs.relative_to('/')}/a.txt"}


def test_follow_symlinks_no_gitignore_hidden_and_globs(tmp_path: Path) -> None:
    docs = _tree(tmp_path)
    followed = discover([str(docs)], follow_symlinks=True)
    assert "secret.txt" not in {Path(s.name).name for s in followed.sources}
    assert "out-link" in {Path(s.name).name for s in followed.sources}
    everything = discover([str(docs)], gitignore=False, hidden=True)
    names = {Path(s.name).name for s in everything.sources}
    assert {"x.log", "gen.txt", ".hidden.txt", ".gitignore"} <= names
    only_py = discover([str(docs)], include=["*.py"])
    assert [Path(s.name).name for s in only_py.sources] == ["b.py"]
    no_sub = discover([str(docs)], exclude=["sub/", "*.dat"])
    names = {Path(s.name).name for s in no_sub.sources}
    assert "b.py" not in names and "keep.log" not in names and "bin.dat" not in names
    assert "a.txt" in names


def test_out_folder_inside_the_input_is_not_read(tmp_path: Path) -> None:
    docs = _tree(tmp_path)
    out = docs / "summaries"
    out.mkdir()
    (out / "a.txt.md").write_text("# old summary\n")
    found = discover([str(docs)], skip_dirs=[out])
    assert not any("summaries" in s.name for s in found.sources)


def test_permission_denied_is_a_reason(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root reads a chmod 000 file; the symlink loop above fails for root too")
    f = tmp_path / "locked.txt"
    f.write_text("secret\n")
    f.chmod(0)
    (src,) = discover([str(f)]).sources
    with pytest.raises(Unreadable, match=r"unreadable \(Permission denied\)"):
        read_source(src)


def test_names_given_twice_and_missing_paths(tmp_path: Path) -> None:
    docs = _tree(tmp_path)
    a = str(docs / "a.txt")
    found = discover([a, a, "-"])
    assert [s.name for s in found.sources] == [a, "<stdin>"]
    with pytest.raises(LocalLLMError, match="no such file or folder: .*nope"):
        discover([str(tmp_path / "nope")])
    with pytest.raises(LocalLLMError, match="only once"):
        discover(["-", "-"])


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_outputs_get_the_mode_of_a_plain_open(tmp_path: Path, umask: int) -> None:
    from localllm.apps.summarize_out import write_atomic

    old = os.umask(umask)
    try:
        write_atomic(tmp_path / "out" / "a.md", "# a\n")
        with open(tmp_path / "plain.md", "w") as f:
            f.write("# a\n")
    finally:
        os.umask(old)
    assert (tmp_path / "out" / "a.md").read_text() == "# a\n"
    # summaries were 0600 whatever the umask (mkstemp's mode)
    mode = (tmp_path / "out" / "a.md").stat().st_mode & 0o777
    assert mode == (tmp_path / "plain.md").stat().st_mode & 0o777 == 0o666 & ~umask
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["a.md"]  # no temporary left
