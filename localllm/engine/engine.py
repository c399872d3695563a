"""The synchronous engine: one step = schedule, run, update, then text output per request."""

from __future__ import annotations

import logging
import math
import threading
from typing import NamedTuple

import torch

from localllm.config import CacheConfig, SamplingParams, SchedulerConfig
from localllm.engine.block_manager import BlockManager
from localllm.engine.metrics import EngineSnapshot, EngineStats, engine_snapshot
from localllm.engine.model_runner import ModelRunner, kv_bytes_per_token
from localllm.engine.prefix_entry import StoreIdentity
from localllm.engine.prefix_store import open_store
from localllm.engine.request import FinishReason, Request, RequestStatus
from localllm.engine.sampler import Sampler
from localllm.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from localllm.errors import PromptTooLong, RequestError
from localllm.loader import LoadedModel
from localllm.memory import release_free_memory
from localllm.text.detokenizer import IncrementalDetokenizer, StopChecker

log = logging.getLogger("localllm")
TRIM_AFTER_PROMPT_TOKENS = 256  # a step this large leaves workspace worth returning

DEFAULT_KV_MEMORY = 1 << 30


class TokenLogprobs(NamedTuple):
    """A sampled token's log-probability under the model (before temperature and filters) and
    the most likely tokens at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, log-probability), most likely first


class RequestOutput(NamedTuple):
    request_id: str
    text: str  # text completed since the previous output of this request
    token_ids: list[int]  # tokens sampled since the previous output
    finished: bool
    finish_reason: str | None
    error: str | None
    # when the request asked for them: one entry per token of `token_ids` that is not a stop
    # token hidden from the text
    logprobs: list[TokenLogprobs] | None = None
    # prompt tokens whose K/V came from the prefix cache (memory or disk) at admission
    cached_tokens: int = 0


def store_identity(loaded: LoadedModel, runner: ModelRunner) -> StoreIdentity:
    """Whose K/V the prefix store may give this engine: same weights, backend, pool layout."""
    pool = runner.kv_caches[0].k  # [num_blocks, block_size, num_kv_heads, head_dim]
    return StoreIdentity(fingerprint=loaded.fingerprint, backend=loaded.backend.name,
                         kv_dtype=str(pool.dtype).removeprefix("torch."),
                         block_size=pool.shape[1], num_layers=len(runner.kv_caches),
                         num_kv_heads=pool.shape[2], head_dim=pool.shape[3],
                         model_name=loaded.path.name)


class _TextState:
    def __init__(self, engine: LLMEngine, req: Request) -> None:
        self.detok = IncrementalDetokenizer(engine.tokenizer)
        self.stops = StopChecker(req.params.stop)
        self.sent_tokens = 0


class LLMEngine:
    def __init__(self, loaded: LoadedModel, cache: CacheConfig | None = None,
                 sched: SchedulerConfig | None = None) -> None:
        cache = cache or CacheConfig()
        sched = sched or SchedulerConfig()
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        # built here, not inside the first request's time to first token
        self.tokenizer.prepare_decoding()
        cfg = loaded.config
        self.max_model_len = min(sched.max_model_len or cfg.context_length, cfg.context_length)
        if sched.max_model_len > cfg.context_length:
            log.warning("max model length %d is more than the %d tokens this model was trained "
                        "on; serving %d", sched.max_model_len, cfg.context_length,
                        cfg.context_length)
        per_block = kv_bytes_per_token(cfg, loaded.model.dtype) * cache.block_size
        if cache.num_blocks:
            num_blocks = cache.num_blocks
        else:
            budget = cache.memory_bytes or min(DEFAULT_KV_MEMORY,
                                               loaded.backend.kv_memory_available() // 4)
            useful = sched.max_num_seqs * -(-self.max_model_len // cache.block_size)
            num_blocks = max(1, min(budget // per_block, useful))
        self.num_blocks = num_blocks
        self.block_size = cache.block_size
        self.runner = ModelRunner(loaded.model, num_blocks, cache.block_size)
        self.store = open_store(cache, store_identity(loaded, self.runner), self.runner)
        self.bm = BlockManager(num_blocks, cache.block_size, loaded.fingerprint,
                               store=self.store, kv_window=loaded.config.kv_window())
        # NOTE: no sequence may outgrow the KV pool: it would be preempted and retried forever.
        max_seq_len = min(self.max_model_len, num_blocks * cache.block_size)
        if max_seq_len < self.max_model_len:
            whole = -(-self.max_model_len // cache.block_size) * per_block / 2**30
            log.warning("the KV cache holds %d tokens, fewer than the %d-token context: a "
                        "request stops there (finish reason length); --kv-cache-memory %.2f "
                        "holds a whole context", max_seq_len, self.max_model_len,
                        math.ceil(whole * 100) / 100)
        self.scheduler = Scheduler(sched, self.bm, max_seq_len)
        self.sampler = Sampler(loaded.backend)
        self.stats = EngineStats()
        self._texts: dict[str, _TextState] = {}
        self._requests: dict[str, Request] = {}
        self._logprobs: dict[str, TokenLogprobs] = {}  # of the token each request just sampled
        self._aborts: list[str] = []
        self._steps_failed = False  # a several-steps decode call raised: one step a call
        self._lock = threading.Lock()
        self._kv_bytes = num_blocks * per_block
        log.info("%s", self.kv_summary())

    def kv_summary(self) -> str:
        store = f"; prefix cache {self.store.dir}" if self.store is not None else ""
        return (f"KV cache {self.num_blocks} blocks x {self.block_size} tokens = "
                f"{self.num_blocks * self.block_size} tokens, {self._kv_bytes / 2**20:.0f} MiB; "
                f"context {self.max_model_len}{store}")

    def close(self) -> None:
        """Write the prefix store's queued blocks and stop its threads (also done at exit)."""
        if self.store is not None:
            self.store.close()

    # ----------------------------------------------------------------- requests in and out
    def check_prompt(self, prompt_ids: list[int]) -> None:
        """Raise RequestError when `add_request` would refuse these prompt ids (PromptTooLong
        where they do not fit the context or the KV cache); thread-safe."""
        n = len(prompt_ids)
        if not n:
            raise RequestError("the prompt is empty; give at least one token of text")
        if n >= self.max_model_len:
            raise PromptTooLong(
                f"the prompt has {n} tokens but the context holds {self.max_model_len} "
                f"({n - self.max_model_len + 1} too many, leaving room for one new token); "
                + ("shorten the prompt or raise --max-model-len"
                   if self.max_model_len < self.loaded.config.context_length else
                   "shorten the prompt (that is the model's whole context)"))
        if self.bm.blocks_needed(n + 1) > self.num_blocks:
            raise PromptTooLong(
                f"the prompt has {n} tokens but the KV cache holds only "
                f"{self.num_blocks * self.block_size}; raise --kv-cache-memory")
        vocab = self.loaded.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise RequestError(f"the prompt has a token id outside the vocabulary (0..{vocab - 1})")

    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    request_id: str | None = None) -> Request:
        self.check_prompt(prompt_ids)
        req = Request(prompt_ids, params, request_id)
        if req.request_id in self._requests:
            raise RequestError(f"request id {req.request_id!r} is already in use")
        with self._lock:
            self._requests[req.request_id] = req
            self._texts[req.request_id] = _TextState(self, req)
            self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> None:
        """Thread-safe: the request ends (reason 'abort') at the next step boundary."""
        with self._lock:
            self._aborts.append(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborts)

    # ----------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        with self._lock:
            aborts, self._aborts = self._aborts, []
        for rid in aborts:
            req = self._requests.get(rid)
            if req is not None and not req.is_finished:
                self.scheduler.finish(req, FinishReason.ABORT)
                outputs.append(self._output(req, []))
        out = self.scheduler.schedule()
        if not out.scheduled:
            return outputs
        steps = self._call_steps(out)
        ahead = self._run_steps(out, steps) if steps > 1 else None
        if ahead is None:
            self._finish_step(out, self._run(out), outputs)
            return outputs
        # each step's tokens as if it had been a step of its own: requests that finish (a stop
        # token or string, max_tokens) take no part in the steps after, whose tokens for them
        # are dropped; a request that samples used one draw of its stream per step it took
        for j, sampled in enumerate(ahead):
            live = [s for s in out.scheduled if s.request.status is RequestStatus.RUNNING]
            if not live:
                break
            for s in live:
                if s.request.draws is not None:
                    s.request.draws.count += 1
            self._finish_step(SchedulerOutput(live, out.preempted if j == 0 else []),
                              {s.request.request_id: sampled[s.request.request_id]
                               for s in live}, outputs)
        return outputs

    def _finish_step(self, out: SchedulerOutput, sampled: dict[str, int],
                     outputs: list[RequestOutput]) -> None:
        self.scheduler.update(out, sampled, self.tokenizer.stop_ids)
        if (sum(s.num_new_tokens for s in out.scheduled) >= TRIM_AFTER_PROMPT_TOKENS
                and all(s.samples for s in out.scheduled) and not self.scheduler.waiting):
            # the prompts are done and decode steps follow: hand their workspace back
            release_free_memory()
        self.stats.record_step(out.num_tokens, len(out.preempted))
        for s in out.scheduled:
            req = s.request
            if req.request_id in sampled or req.is_finished:
                new = [sampled[req.request_id]] if req.request_id in sampled else []
                outputs.append(self._output(req, new))

    def _call_steps(self, out: SchedulerOutput) -> int:
        """How many decode steps this batch runs in one call: up to `decode_steps` where every
        request decodes one token, greedily or sampled with a top-k the backend's path draws
        itself, with nothing to apply to its logits (no repetition penalty, no
        log-probabilities, no padded vocabulary to mask), no abort is pending and no request
        waits but for a running one to end (max_num_seqs run); else 1. A request admitted or
        aborted meanwhile waits for the call."""
        sch = self.scheduler
        steps = sch.config.decode_steps
        blocked = sch.waiting and len(sch.running) < sch.config.max_num_seqs
        path = self.runner.decode_steps if steps > 1 else None
        if (path is None or out.preempted or blocked or self._aborts
                or self._steps_failed
                or self.loaded.config.vocab_size > self.tokenizer.vocab_size
                or len(out.scheduled) > path.max_seqs):
            return 1
        for s in out.scheduled:
            p = s.request.params
            drawn = p.greedy or 0 < p.top_k <= min(path.max_top_k,
                                                   self.loaded.config.vocab_size - 1)
            if (s.num_new_tokens != 1 or not s.samples or not drawn
                    or p.repetition_penalty != 1.0 or p.logprobs is not None):
                return 1
        return sch.reserve_ahead(out, steps)

    def _run_steps(self, out: SchedulerOutput, steps: int) -> list[dict[str, int]] | None:
        """The sampled tokens of `steps` decode steps of the batch run in one call (fewer up
        to a step whose best logit is not finite), or None where the backend did not run them
        (the batch then takes a step of its own, which reports any error)."""
        try:
            got = self.runner.execute_steps(out.scheduled, steps)
        except Exception:
            # not again: a failure that repeats would cost a call and a traceback every step
            log.exception("a several-steps decode call failed; decoding one step a call from "
                          "now")
            self._steps_failed = True
            return None
        if got is None:
            return None
        ids = [s.request.request_id for s in out.scheduled]
        ahead = []
        for best, best_logit in zip(got.best, got.best_logit):
            if not all(map(math.isfinite, best_logit)):
                break
            ahead.append(dict(zip(ids, best)))
        return ahead or None

    def _run(self, out: SchedulerOutput) -> dict[str, int]:
        try:
            return self._run_batch(out.scheduled)
        except Exception:
            log.exception("a batched step failed; retrying its requests one by one")
        sampled: dict[str, int] = {}
        for s in out.scheduled:
            try:
                sampled.update(self._run_batch([s]))
            except Exception as e:
                log.exception("request %s failed", s.request.request_id)
                self.scheduler.finish(s.request, FinishReason.ERROR,
                                      f"{type(e).__name__}: {e}")
        return sampled

    def _run_batch(self, batch: list[ScheduledRequest]) -> dict[str, int]:
        logits, sampling, best, best_logit = self.runner.execute(batch)
        if not sampling:
            return {}
        if logits.shape[-1] > self.tokenizer.vocab_size:
            # embeddings padded past the tokenizer: those ids have no text, never sample them
            logits[:, self.tokenizer.vocab_size:] = float("-inf")
            best = None
        if best is None or best_logit is None:
            top = self.runner.backend.argmax(logits)
            best, best_logit = top.tolist(), logits.gather(1, top[:, None]).view(-1).tolist()
        # each row's best logit must be finite (a full isfinite pass costs 0.4 ms a step)
        if not all(map(math.isfinite, best_logit)):
            raise FloatingPointError("the model produced no finite logits")
        tokens = self.sampler(logits, sampling, best)
        rows = [i for i, r in enumerate(sampling) if r.params.logprobs is not None]
        if rows:
            self._record_logprobs(logits, rows, sampling, tokens)
        return {r.request_id: t for r, t in zip(sampling, tokens)}

    def _record_logprobs(self, logits: torch.Tensor, rows: list[int],
                         sampling: list[Request], tokens: list[int]) -> None:
        # logits: [num_seqs, vocab]
        lp = torch.log_softmax(logits[rows].float(), dim=-1)  # [len(rows), vocab]
        chosen = lp.gather(1, torch.tensor([[tokens[i]] for i in rows], device=lp.device))
        k = max(sampling[i].params.logprobs or 0 for i in rows)
        top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
        chosen_l, top_vl, top_il = chosen[:, 0].tolist(), top_v.tolist(), top_i.tolist()
        for j, i in enumerate(rows):
            n = sampling[i].params.logprobs or 0
            top = tuple(zip(top_il[j][:n], top_vl[j][:n]))
            self._logprobs[sampling[i].request_id] = TokenLogprobs(tokens[i], chosen_l[j], top)

    def _output(self, req: Request, new: list[int]) -> RequestOutput:
        st = self._texts[req.request_id]
        text = ""
        hit = False
        wanted = req.params.logprobs is not None
        logprobs: list[TokenLogprobs] | None = [] if wanted else None
        lp = self._logprobs.pop(req.request_id, None) if wanted else None
        for t in new:
            if t in self.tokenizer.stop_ids and not req.params.ignore_eos:
                continue
            if logprobs is not None and lp is not None:
                logprobs.append(lp)
            piece, hit = st.stops.feed(st.detok.add(t))
            text += piece
            if hit:
                break
        if hit and not req.is_finished:
            self.scheduler.finish(req, FinishReason.STOP)
        if req.is_finished:
            if not hit and req.finish_reason is not FinishReason.ABORT:
                tail, hit = st.stops.feed(st.detok.flush())
                text += tail
                if not hit:
                    text += st.stops.flush()
            del self._texts[req.request_id]
            del self._requests[req.request_id]
        reason = req.finish_reason.value if req.finish_reason else None
        return RequestOutput(req.request_id, text, new, req.is_finished, reason, req.error,
                             logprobs, req.num_cached_tokens)

    def snapshot(self) -> EngineSnapshot:
        """Metrics of this moment; call on the stepping thread (AsyncLLMEngine.stats elsewhere)."""
        return engine_snapshot(self)

    @property
    def num_running(self) -> int:
        return sum(1 for r in self.scheduler.running if r.status is RequestStatus.RUNNING)
