"""The Python API: `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch

from localllm.backends import make_backend
from localllm.config import DTYPES, CacheConfig, SamplingParams, SchedulerConfig
from localllm.engine.engine import LLMEngine, RequestOutput
from localllm.engine.request import RequestTimes
from localllm.errors import ModelLoadError, RequestError
from localllm.hf import is_hf_checkpoint, load_hf
from localllm.loader import ProgressFn, load_gguf
from localllm.model_path import find_model
from localllm.quant.quantize import QUANTIZE_MODES
from localllm.text.chat_encode import encode_chat
from localllm.text.chat_template import ChatTemplate

Message = dict[str, str]


class Completion(NamedTuple):
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str | None
    error: str | None
    times: RequestTimes


class LLM:
    def __init__(self, model: str | os.PathLike[str] | None = None, dtype: str = "bfloat16",
                 cache: CacheConfig | None = None, scheduler: SchedulerConfig | None = None,
                 num_threads: int | None = None, progress: ProgressFn | None = None,
                 quantize: str | None = None, device: str = "auto",
                 backend: str = "auto") -> None:
        """`model`: a GGUF file or a Hugging Face checkpoint folder. `quantize` ("int8",
        "int4" or "nf4") quantizes a Hugging Face checkpoint's linear weights on load.
        `device`: "auto" (a CUDA GPU when PyTorch sees one, else the CPU), "cpu" or "cuda"
        (an error without a GPU); `backend`: "auto", "cpu", "triton" or "torch" (see
        `localllm.backends.make_backend`). `cache` also configures the on-disk prefix cache,
        on by default (`CacheConfig.prefix_cache`)."""
        if dtype not in DTYPES:
            raise RequestError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
        if quantize is not None and quantize not in QUANTIZE_MODES:
            raise RequestError(f"unknown quantization {quantize!r} (choose from "
                               f"{', '.join(QUANTIZE_MODES)})")
        if num_threads is not None and num_threads < 1:
            raise RequestError(f"num_threads must be at least 1, got {num_threads}")
        self.backend = make_backend(device, backend)
        if num_threads:
            torch.set_num_threads(num_threads)
        self.path = find_model(model)
        if is_hf_checkpoint(self.path):
            self.loaded = load_hf(self.path, DTYPES[dtype], progress, quantize, self.backend)
        elif quantize is not None:
            raise ModelLoadError(f"{self.path}: --quantize applies to Hugging Face checkpoint "
                                 f"folders; a GGUF file keeps its own quantization")
        else:
            self.loaded = load_gguf(self.path, DTYPES[dtype], progress, backend=self.backend)
        self.tokenizer = self.loaded.tokenizer
        self.config = self.loaded.config
        self.template = ChatTemplate(self.tokenizer.chat_template, self.tokenizer.bos_token,
                                     self.tokenizer.eos_token)
        self.engine = LLMEngine(self.loaded, cache, scheduler)

    def close(self) -> None:
        """Finish writing the on-disk prefix cache (also done when the process exits)."""
        self.engine.close()

    # ------------------------------------------------------------------ prompts
    def encode(self, text: str) -> list[int]:
        """Raw text -> ids, BOS/EOS as the model's metadata says, special text kept plain."""
        return self.tokenizer.encode(text, add_special=True, parse_special=False)

    def encode_chat(self, messages: Sequence[Message]) -> list[int]:
        """Messages through the chat template; message text never becomes special tokens."""
        return encode_chat(self.tokenizer, self.template, messages)

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | None = None) -> list[Completion]:
        """Run every prompt to completion, batched; results in the order of the prompts."""
        params = params or SamplingParams()
        if isinstance(prompts, str):
            prompts = [prompts]
        ids = [self.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        return self._run_all(ids, params)

    def chat(self, conversations: Sequence[Message] | Sequence[Sequence[Message]],
             params: SamplingParams | None = None) -> list[Completion]:
        """One conversation (a list of messages) or several; one completion each."""
        params = params or SamplingParams()
        convs: list[Sequence[Message]]
        if conversations and isinstance(conversations[0], dict):
            convs = [conversations]  # type: ignore[list-item]
        else:
            convs = list(conversations)  # type: ignore[arg-type]
        return self._run_all([self.encode_chat(c) for c in convs], params)

    def _run_all(self, ids: list[list[int]], params: SamplingParams) -> list[Completion]:
        reqs = [self.engine.add_request(p, params) for p in ids]
        texts = {r.request_id: "" for r in reqs}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                texts[out.request_id] += out.text
        return [Completion(texts[r.request_id], list(r.output_ids), list(r.prompt_ids),
                           r.finish_reason.value if r.finish_reason else None, r.error, r.times)
                for r in reqs]

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[RequestOutput]:
        """Generate for one prompt, yielding text pieces as they complete. Closing the
        iterator early (Ctrl-C, a consumer that stops) aborts the request."""
        req = self.engine.add_request(prompt_ids, params)
        try:
            while not req.is_finished:
                for out in self.engine.step():
                    if out.request_id == req.request_id:
                        yield out
        finally:
            if not req.is_finished:
                self.engine.abort(req.request_id)
                self.engine.step()
