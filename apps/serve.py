"""`localllm serve`: the local API for editors and scripts (OpenAI- and Ollama-compatible).

It listens on a Unix socket (default: `localllm.sock` in a private directory of the user's
runtime directory, mode 0600) and, with `--host`/`--port`, on loopback TCP, where every request
needs the API key (`--api-key` or `$LOCALLLM_API_KEY`); a non-loopback host needs
`--allow-remote`. The sockets are bound before the model loads, so a taken socket or port
fails at once. stderr shows where it listens, then a line with "ready" when it accepts
requests, then one access-log line per request. SIGTERM or SIGINT: open streams get
`--shutdown-timeout` seconds to finish, the socket file is removed.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from localllm.apps.arg_types import tcp_port

DEFAULT_PORT = 8080


def add_parser(sub: Any, model_args: Any) -> None:
    s = sub.add_parser("serve", help="serve the OpenAI- and Ollama-compatible API on a Unix "
                       "socket (and loopback TCP with an API key)")
    model_args(s)
    s.add_argument("--socket", default=None, metavar="PATH",
                   help="Unix socket path (default: localllm.sock in the user's runtime "
                   "directory)")
    s.add_argument("--host", default=None,
                   help="also listen on TCP at this address (loopback; needs --api-key)")
    s.add_argument("--port", type=tcp_port, default=None,
                   help=f"TCP port (default {DEFAULT_PORT}; 0: any free port, shown at start; "
                   f"implies --host 127.0.0.1)")
    s.add_argument("--api-key", default=None,
                   help="key TCP clients send as 'Authorization: Bearer KEY' (default: "
                   "$LOCALLLM_API_KEY)")
    s.add_argument("--allow-remote", action="store_true",
                   help="allow --host to be an address other machines can reach")
    s.add_argument("--model-name", default=None,
                   help="the model's name in the API (default: the model file's name)")
    s.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template to use instead of the model's")
    s.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="let web pages from ORIGIN (such as http://localhost:3000, or "
                   "chrome-extension://ID; '*' for any) call the API from a browser; "
                   "repeatable (default: none; the API key is still required over TCP)")
    s.add_argument("--log-prompts", action="store_true",
                   help="put prompt text in the access log (default: counts only)")
    s.add_argument("--max-request-bytes", type=int, default=8 << 20,
                   help="largest request body accepted (default 8 MiB)")
    s.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="how long open streams may run on after SIGTERM/SIGINT (default 10)")


def _model_name(path: Path) -> str:
    return path.name.removesuffix(".gguf") if path.is_file() else path.name


def cmd_serve(args: argparse.Namespace, load_llm: Any) -> int:
    import torch

    from localllm.engine.async_engine import AsyncLLMEngine
    from localllm.model_card import gguf_scalars
    from localllm.server.runner import serve
    from localllm.server.state import ServeOptions, ServerState
    from localllm.server.transport import (
        ServeError,
        UnixSocket,
        default_socket_path,
        tcp_listener,
    )
    from localllm.text.chat_template import ChatTemplate
    from localllm.text.fim import find_fim_tokens

    key = args.api_key or os.environ.get("LOCALLLM_API_KEY") or None
    tcp = args.host is not None or args.port is not None
    if tcp and not key:
        raise ServeError("TCP needs an API key: pass --api-key KEY or set LOCALLLM_API_KEY "
                         "(clients send it as 'Authorization: Bearer KEY')")
    if args.max_request_bytes < 1024 or args.shutdown_timeout < 0:
        raise ServeError("--max-request-bytes must be at least 1024 and --shutdown-timeout "
                         "not negative")
    template_src = None
    if args.chat_template:
        try:
            template_src = Path(args.chat_template).read_text(encoding="utf-8")
        except OSError as e:
            raise ServeError(f"--chat-template {args.chat_template}: {e.strerror}") from None
    for name in ("localllm.serve", "localllm.access"):
        logging.getLogger(name).setLevel(logging.INFO)

    path = Path(args.socket).expanduser() if args.socket else default_socket_path()
    unix = UnixSocket(path, default_dir=args.socket is None)
    try:
        listeners = [unix.listener]
        if tcp:
            port = DEFAULT_PORT if args.port is None else args.port
            listeners.append(tcp_listener(args.host or "127.0.0.1", port, args.allow_remote))
        for lst in listeners:
            note = " (API key required)" if lst.where.startswith("http") else ""
            print(f"localllm serve: listening on {lst.where}{note}", file=sys.stderr)
        signal.signal(signal.SIGTERM, _terminate)  # until uvicorn takes over: clean exit
        threads = args.threads or torch.get_num_threads()
        llm = load_llm(args, threads=1)
        template = (ChatTemplate(template_src, llm.tokenizer.bos_token, llm.tokenizer.eos_token)
                    if template_src is not None else llm.template)
        meta = gguf_scalars(llm.path)
        engine = AsyncLLMEngine(llm.engine, num_threads=threads)
        state = ServerState(llm, engine, args.model_name or _model_name(llm.path),
                            ServeOptions(api_key=key, log_prompts=args.log_prompts,
                                         max_body_bytes=args.max_request_bytes,
                                         shutdown_timeout=args.shutdown_timeout,
                                         cors_origins=tuple(args.cors_origin)),
                            template=template, fim=find_fim_tokens(llm.tokenizer, meta),
                            metadata=meta)

        def ready() -> None:
            print(f"localllm serve: ready: {state.model_name}, context {state.max_model_len}"
                  f"{', fill-in-the-middle' if state.fim else ''}"
                  f"{', tools' if template.takes_tools else ''}", file=sys.stderr, flush=True)

        try:
            serve(state, [lst.sock for lst in listeners], ready)
        finally:
            engine.shutdown(timeout=10)
            llm.close()  # the prefix cache's last blocks reach the disk
    except _Terminated:
        pass
    finally:
        for lst in listeners[1:]:
            lst.sock.close()
        unix.close()
    print("localllm serve: stopped", file=sys.stderr)
    return 0


class _Terminated(Exception):
    pass


def _terminate(signum: int, frame: Any) -> None:
    raise _Terminated
