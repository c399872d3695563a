"""`localllm cache stats|clear|path`: the on-disk prefix cache, per model; and the options of
the model commands that configure it (`--prefix-cache-dir`, `--no-prefix-cache`,
`--prefix-cache-size`)."""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from localllm.apps.arg_types import byte_size

if TYPE_CHECKING:
    from localllm.config import CacheConfig

def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def add_store_args(p: argparse.ArgumentParser) -> None:
    """The options of model commands (generate, chat)."""
    p.add_argument("--prefix-cache-dir", default=None, metavar="DIR",
                   help="where prompt prefixes are kept across runs (default: "
                   "$LOCALLLM_PREFIX_CACHE_DIR, else the user cache directory)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="neither read nor save prompt prefixes on disk")
    p.add_argument("--prefix-cache-size", type=byte_size(1, "bytes"), default=None,
                   metavar="SIZE", help="size budget of the prefix cache directory, least "
                   "recently used entries go first: 4G (GiB), 500M, 8GB (default: 4G)")


def cache_config(args: argparse.Namespace, memory_bytes: int) -> CacheConfig:
    """The CacheConfig of a model command: its KV memory and the options of `add_store_args`."""
    from localllm.config import DEFAULT_PREFIX_CACHE_BYTES, CacheConfig

    switch = False if args.no_prefix_cache else (True if args.prefix_cache_dir else None)
    return CacheConfig(memory_bytes=memory_bytes, prefix_cache=switch,
                       prefix_cache_dir=args.prefix_cache_dir,
                       prefix_cache_bytes=args.prefix_cache_size or DEFAULT_PREFIX_CACHE_BYTES)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    c = sub.add_parser("cache", help="the on-disk prefix cache: stats, clear, path")
    cs = c.add_subparsers(dest="cache_command", required=True)
    parts = {name: cs.add_parser(name, help=text) for name, text in (
        ("stats", "entries, bytes and hit rate per model"),
        ("clear", "delete stored prefixes (of one model with --model)"),
        ("path", "print the directory"))}
    for p in parts.values():
        p.add_argument("--prefix-cache-dir", default=None, metavar="DIR",
                       help="the directory (default: $LOCALLLM_PREFIX_CACHE_DIR, else the user "
                       "cache directory)")
    parts["clear"].add_argument("--model", "-m", default=None, metavar="M",
                                help="a model file, its name, or a model id from `stats`")


def _root(args: argparse.Namespace) -> Path:
    from localllm.config import CacheConfig
    from localllm.engine.prefix_store import store_dir

    root = store_dir(CacheConfig(prefix_cache=True, prefix_cache_dir=args.prefix_cache_dir))
    assert root is not None
    return root


def _matches(usage_model: str, identity: dict[str, object], spec: str) -> bool:
    from localllm.loader import file_fingerprint

    if len(spec) >= 4 and usage_model.startswith(spec.lower()):
        return True
    if identity.get("model_name") == Path(spec).name:
        return True
    path = Path(spec).expanduser()
    return path.is_file() and identity.get("fingerprint") == file_fingerprint(path)


def cmd_cache(args: argparse.Namespace) -> int:
    root = _root(args)
    if args.cache_command == "path":
        print(root)
        return 0
    if root.exists() and not root.is_dir():
        print(f"localllm: error: prefix cache {root}: not a directory; give a directory with "
              "--prefix-cache-dir", file=sys.stderr)
        return 2
    if not root.is_dir():
        print(f"prefix cache {root}: empty")
        return 0
    try:
        return _stats_or_clear(args, root)
    except (OSError, sqlite3.Error) as e:
        print(f"localllm: error: prefix cache {root}: {e}", file=sys.stderr)
        return 2


def _stats_or_clear(args: argparse.Namespace, root: Path) -> int:
    from localllm.engine.prefix_index import INDEX_NAME, clear_models, open_index

    had_index = (root / INDEX_NAME).exists()
    try:
        index = open_index(root)  # rebuilds a missing or broken index from the entries
    except sqlite3.OperationalError:
        if args.cache_command != "stats":
            raise
        index = open_index(root, readonly=True)  # a read-only directory
    try:
        usage = index.usage()
    finally:
        index.close()
    if not had_index and not usage:  # no cache here: leave the folder as it was
        for suffix in ("", "-wal", "-shm", ".lock"):
            (root / (INDEX_NAME + suffix)).unlink(missing_ok=True)
        print(f"prefix cache {root}: empty")
        return 0
    idents = {u.model: json.loads(u.identity) if u.identity else {} for u in usage}
    if args.cache_command == "clear":
        chosen = [u for u in usage
                  if args.model is None or _matches(u.model, idents[u.model], args.model)]
        if args.model is not None and not chosen:
            print(f"prefix cache {root}: nothing stored for {args.model}", file=sys.stderr)
            return 1
        clear_models(root, [u.model for u in chosen])
        print(f"cleared {sum(u.entries for u in chosen)} entries, "
              f"{human(sum(u.bytes for u in chosen))}, of {len(chosen)} model(s)")
        return 0
    total = sum(u.bytes for u in usage)
    print(f"prefix cache {root}: {sum(u.entries for u in usage)} entries, {human(total)}")
    if not usage:
        return 0
    names = {u.model: f"{idents[u.model].get('model_name') or '?'} ({u.model[:12]})"
             for u in usage}
    width = max(34, *map(len, names.values()))  # a long file name widens the column
    print(f"{'model':<{width}} {'backend':<7} {'kv dtype':<9} {'entries':>8} {'tokens':>9} "
          f"{'size':>10} {'hit rate':>8}  last used")
    for u in usage:
        ident = idents[u.model]
        name = names[u.model]
        block = int(str(ident.get("block_size", 0)))
        tokens = str(u.entries * block) if block else "?"
        rate = f"{100 * u.hits / u.lookups:.1f}%" if u.lookups else "-"
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(u.last_used)) if u.entries else "-"
        print(f"{name:<{width}} {ident.get('backend', '?')!s:<7} {ident.get('kv_dtype', '?')!s:<9} "
              f"{u.entries:>8} {tokens:>9} {human(u.bytes):>10} {rate:>8}  {when}")
    return 0
