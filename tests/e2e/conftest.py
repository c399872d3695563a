"""Live `localllm serve` processes shared by the test_serve_* modules (one start each per run).

`stories_server`: stories260K in fp32 on a temporary Unix socket and on loopback TCP (an
ephemeral port) with API key `KEY`, a 64 KiB body limit. `smollm_server`: the default model
with the real Qwen2.5 chat template (it renders tools; its markers are ChatML tokens the SmolLM
vocabulary has), on a socket and TCP.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from serve_util import KEY, ServeProcess

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"


@pytest.fixture(scope="session")
def stories_server(stories_path: Path, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[ServeProcess]:
    sock = tmp_path_factory.mktemp("serve-stories") / "s.sock"
    server = ServeProcess.start(
        ["--model", str(stories_path), "--dtype", "float32", "--threads", "1",
         "--host", "127.0.0.1", "--port", "0", "--api-key", KEY,
         "--max-request-bytes", str(64 << 10), "--shutdown-timeout", "2",
         "--kv-cache-memory", "0.05"], sock)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def smollm_server(smollm_path: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[ServeProcess]:
    sock = tmp_path_factory.mktemp("serve-smollm") / "s.sock"
    server = ServeProcess.start(
        ["--model", str(smollm_path), "--threads", "1", "--host", "127.0.0.1", "--port", "0",
         "--api-key", KEY, "--chat-template", str(TEMPLATES / "qwen2.5-instruct.jinja"),
         "--model-name", "smollm", "--kv-cache-memory", "0.05", "--max-model-len", "2048"],
        sock)
    yield server
    server.stop()
