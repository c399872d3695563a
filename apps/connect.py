"""`--endpoint` and `--api-key`: the apps run on the in-process engine or a remote server."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from localllm.client.base import Client
    from localllm.llm import LLM

LoadFn = Callable[..., "LLM"]


def add_endpoint_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", default=None, metavar="URL",
                   help="use an OpenAI-compatible server instead of loading a model here: "
                   "http(s)://host:port[/v1] (vLLM, SGLang, llama-server, `localllm serve "
                   "--port`) or unix:/path/to.sock (`localllm serve`'s socket; `unix:` alone: "
                   "the one it listens on by default); --model then names the server's model "
                   "(default: the first it lists)")
    p.add_argument("--api-key", default=None,
                   help="API key for --endpoint (default: $LOCALLLM_API_KEY, then "
                   "$OPENAI_API_KEY)")


async def open_client(args: argparse.Namespace, load: LoadFn) -> Client:
    """A RemoteClient for --endpoint, else a LocalClient on the model `load(args, threads=1)`
    loads: the loading thread keeps one torch thread, the engine thread gets --threads (or
    all; see AsyncLLMEngine on OpenMP teams)."""
    if args.endpoint:
        from localllm.client.remote import RemoteClient

        key = args.api_key or os.environ.get("LOCALLLM_API_KEY") or os.environ.get(
            "OPENAI_API_KEY")
        return await RemoteClient.connect(args.endpoint, key, args.model,
                                          getattr(args, "extra_body", None))
    import torch

    from localllm.client.local import LocalClient

    threads = args.threads or torch.get_num_threads()
    return LocalClient(load(args, threads=1), threads, getattr(args, "quantize", None))
