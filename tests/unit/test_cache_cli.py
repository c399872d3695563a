"""`localllm cache stats|clear|path` and the prefix-cache options of the model commands, on a
small synthetic model."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pytest
from gguf_factory import ModelSpec, write_model

from localllm.apps.arg_types import GIB, byte_size
from localllm.apps.cli import build_parser, main
from localllm.engine import prefix_store, prefix_writer
from localllm.engine.prefix_index import StoreIndex

PROMPT = "hello world " * 12

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("cache-cli")
    spec = ModelSpec(hidden=64, ffn=128, heads=4, kv_heads=2, layers=2)
    return (write_model(d / "one.gguf", spec).path,
            write_model(d / "two.gguf", ModelSpec(**{**spec.__dict__, "seed": 3})).path)


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def generate(capsys: pytest.CaptureFixture[str], model: Path, *opts: str) -> tuple[str, str]:
    rc, out, err = cli(capsys, "generate", "--model", str(model), "--dtype", "float32",
                       "--temperature", "0", "--max-tokens", "4", *opts, PROMPT)
    assert rc == 0, err
    return out, err


def test_sizes_mean_the_same_in_every_option() -> None:
    parse = byte_size(1, "bytes")
    assert parse("4G") == 4 << 30 and parse("512M") == 512 << 20 and parse("4g") == 4 << 30
    assert parse("1.5GiB") == 3 << 29 and parse("100000") == 100000
    assert parse("8GB") == 8 * 10**9 and parse("1.5kb") == 1500  # decimal with a B
    assert byte_size(GIB, "GiB")("0.5") == 1 << 29
    for bad in ("", "-1G", "4X", "G", "0", "0.1b", "1e9"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)
    args = build_parser().parse_args
    assert args(["generate", "--kv-cache-memory", "512M", "x"]).kv_cache_memory == 512 << 20
    assert args(["generate", "--kv-cache-memory", "2", "x"]).kv_cache_memory == 2 << 30
    assert args(["generate", "--prefix-cache-size", "2GB", "x"]).prefix_cache_size == 2 * 10**9
    assert args(["info", "--memory", "2G"]).memory == 2 << 30


def test_generate_options_stats_and_clear(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                          models: tuple[Path, Path]) -> None:
    store = tmp_path / "store"
    one, two = models
    out1, err1 = generate(capsys, one, "--prefix-cache-dir", str(store))
    assert "(0 cached)" in err1 and f"prefix cache {store}" in err1
    out2, err2 = generate(capsys, one, "--prefix-cache-dir", str(store))
    assert out2 == out1 and "(0 cached)" not in err2
    _, err3 = generate(capsys, one, "--prefix-cache-dir", str(store), "--no-prefix-cache")
    assert "(0 cached)" in err3 and "prefix cache" not in err3
    generate(capsys, two, "--prefix-cache-dir", str(store))

    rc, out, _ = cli(capsys, "cache", "stats", "--prefix-cache-dir", str(store))
    lines = out.splitlines()
    assert rc == 0 and lines[0].startswith(f"prefix cache {store}: ")
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert set(rows) == {"one.gguf", "two.gguf"}
    assert rows["one.gguf"][-3] == "50.0%"  # asked twice, served the second time
    assert rows["two.gguf"][-3] == "0.0%"

    rc, out, _ = cli(capsys, "cache", "clear", "--model", str(one), "--prefix-cache-dir",
                     str(store))
    assert rc == 0 and "of 1 model(s)" in out
    _, out, _ = cli(capsys, "cache", "stats", "--prefix-cache-dir", str(store))
    assert "one.gguf" not in out and "two.gguf" in out
    assert not any((store / d).is_dir() for d in _model_ids(store, "one.gguf"))
    _, err = generate(capsys, one, "--prefix-cache-dir", str(store))
    assert "(0 cached)" in err  # cleared means computed again
    rc, _, err = cli(capsys, "cache", "clear", "--model", "nothing.gguf", "--prefix-cache-dir",
                     str(store))
    assert rc == 1 and "nothing stored for nothing.gguf" in err
    rc, out, _ = cli(capsys, "cache", "clear", "--prefix-cache-dir", str(store))
    assert rc == 0 and "of 2 model(s)" in out
    _, out, _ = cli(capsys, "cache", "stats", "--prefix-cache-dir", str(store))
    assert out.splitlines() == [f"prefix cache {store}: 0 entries, 0 B"]


def test_stats_columns_line_up_with_a_long_file_name(capsys: pytest.CaptureFixture[str],
                                                     tmp_path: Path,
                                                     models: tuple[Path, Path]) -> None:
    store = tmp_path / "store"
    long = tmp_path / "SmolLM2-135M-Instruct-with-a-long-name.Q4_1.gguf"
    long.write_bytes(models[0].read_bytes())
    generate(capsys, long, "--prefix-cache-dir", str(store))
    generate(capsys, models[1], "--prefix-cache-dir", str(store))
    rc, out, _ = cli(capsys, "cache", "stats", "--prefix-cache-dir", str(store))
    header, *rows = out.splitlines()[1:]
    assert rc == 0 and len(rows) == 2
    column = header.index("backend")
    for row in rows:  # every row's backend starts under the header's
        assert row[column:].startswith("cpu ") and row[column - 1] == " ", out


def test_stats_of_a_file_is_an_error(capsys: pytest.CaptureFixture[str],
                                     models: tuple[Path, Path]) -> None:
    for command in ("stats", "clear"):
        rc, out, err = cli(capsys, "cache", command, "--prefix-cache-dir", str(models[0]))
        assert (rc, out) == (2, "")
        assert err == (f"localllm: error: prefix cache {models[0]}: not a directory; give a "
                       "directory with --prefix-cache-dir\n")


def test_a_folder_that_is_no_cache_is_left_as_it_was(capsys: pytest.CaptureFixture[str],
                                                     tmp_path: Path) -> None:
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "todo.txt").write_text("buy milk")
    for command in ("stats", "clear"):
        rc, out, _ = cli(capsys, "cache", command, "--prefix-cache-dir", str(folder))
        assert (rc, out) == (0, f"prefix cache {folder}: empty\n")
        assert sorted(p.name for p in folder.iterdir()) == ["todo.txt"]


def _model_ids(store: Path, name: str) -> list[str]:
    import sqlite3

    con = sqlite3.connect(store / "index-1.sqlite3")
    ids = [m for m, ident in con.execute("SELECT model, identity FROM models")
           if json.loads(ident)["model_name"] == name]
    con.close()
    return ids


def test_cache_path_and_the_environment(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch,
                                        models: tuple[Path, Path]) -> None:
    monkeypatch.setenv(prefix_store.ENV_DIR, str(tmp_path / "env"))
    assert cli(capsys, "cache", "path")[1].strip() == str(tmp_path / "env")
    assert cli(capsys, "cache", "path", "--prefix-cache-dir", "/x")[1].strip() == "/x"
    assert cli(capsys, "cache", "stats")[1].strip() == f"prefix cache {tmp_path / 'env'}: empty"
    monkeypatch.delenv(prefix_store.ENV_SWITCH)  # tests turn the store off; users do not
    _, err = generate(capsys, models[0])
    assert f"prefix cache {tmp_path / 'env'}" in err
    _, err = generate(capsys, models[0], "--prefix-cache-size", "1M")
    assert "(0 cached)" not in err


def test_generate_returns_with_its_blocks_on_disk(capsys: pytest.CaptureFixture[str],
                                                  tmp_path: Path, models: tuple[Path, Path],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    real = prefix_writer.write_entry

    def slow_disk(*args: object) -> int:
        time.sleep(0.05)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(prefix_writer, "write_entry", slow_disk)
    _, err = generate(capsys, models[0], "--prefix-cache-dir", str(tmp_path))
    n = int(err.split("prompt ")[1].split()[0])
    index = StoreIndex(tmp_path, "ro")
    assert index.totals()[0] == (n - 1 + 4) // 16  # prompt and output: every full block
    index.close()
