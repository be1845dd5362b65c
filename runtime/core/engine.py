"""LLMEngine: requests in, tokens out; one `step()` returns one batch of the in-flight scheduler.

The executor (runtime.backends.base.Executor) runs a step: `execute(meta) -> logits`. One that can hold
several steps at once (a multi-rank engine with pp > 1 stages) has `max_in_flight` > 1: then step()
keeps up to max_in_flight batches in flight through `submit` / `collect`, so every stage computes
one, and returns them in the order they were submitted.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer

from runtime.backends import check_target, open_engine
from runtime.backends.base import Executor, create_executor, for_host, kv_groups
from runtime.backends.cpu.cpus import usable_cpus
from runtime.backends.step import build_step_metadata
from runtime.core.chat import render_chat
from runtime.core.constraints import Grammars
from runtime.core.detokenizer import IncrementalDetokenizer
from runtime.core.disaggregation import KVHandoff, cache_layout, check_handoff, layer_tables, read_kv, write_kv
from runtime.core.draft import DraftProposer
from runtime.core.sampler import Sampler, token_logprobs
from runtime.core.sampling import SamplingParams
from runtime.core.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from runtime.core.sequence import Sequence
from runtime.core.speculative import NgramProposer, SpeculativeConfig, Speculator
from runtime.format.engine_format import EngineDir, EngineError, PlanLimits
from runtime.format.special_tokens import from_tokenizer

log = logging.getLogger("kiln.engine")


# Prefill tokens per step while requests decode (runtime/core/scheduler.py). SmolLM2 on 2 AVX2 cores,
# `engine-run bench` at 32 concurrent 128/128 requests: ITL p99 1041-1096 ms with the whole
# 512-token budget, 482 ms at 128, 253-260 ms at 64, at the same output tok/s within noise.
DEFAULT_PREFILL_CHUNK = 64


@dataclass(frozen=True)
class EngineOptions:
    """Start-up settings; limits may only be lowered below the engine's plan (None keeps the plan's)."""

    max_batch_size: int | None = None
    max_num_tokens: int | None = None
    max_seq_len: int | None = None
    prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK  # prefill tokens in a step that decodes (None: no cap)
    kv_cache_gib: float | None = None   # KV budget; default: the blocks the build's memory plan derived
    num_threads: int | None = None
    enable_prefix_caching: bool = True
    check_hashes: bool = True
    rank_timeout: float = 60.0          # multi-rank: seconds a silent rank is given before all ranks stop
    backend: str | None = None          # None: the engine target's own (cpu); onnxruntime: a tensorrt engine's ONNX
    speculative: SpeculativeConfig | None = None  # speculative decoding (runtime/core/speculative.py); None: off
    activations: str | None = None      # cpu: the activation path (one the build allowed); None: the fastest here


@dataclass
class RequestOutput:
    request_id: str
    delta: str                       # text new since the previous output of this request
    text: str                        # all output text so far
    token_ids: list[int]             # all output token ids so far
    finished: bool
    finish_reason: str | None        # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: list[float] | None = None
    # params.top_logprobs: each output position's most likely tokens, (token id, log-prob), most likely first
    top_logprobs: list[tuple[tuple[int, float], ...]] | None = None
    prompt_logprobs: list[float | None] | None = None  # params.prompt_logprobs: one per prompt token, None first
    prompt_top_logprobs: list[tuple[tuple[int, float], ...] | None] | None = None  # ... and their alternatives
    error: str | None = None
    num_proposed_tokens: int = 0     # speculative guesses verified for this request
    num_accepted_tokens: int = 0     # of those, the ones that stood
    kv_handoff: object = None        # a hand_off request's KVHandoff, on its final output


@dataclass
class _Request:
    seq: Sequence
    detok: IncrementalDetokenizer
    error: str | None = None


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    prefix_queries: int
    prefix_hits: int
    num_preemptions: int
    prompt_tokens: int = 0
    generated_tokens: int = 0
    batches_in_flight: int = 0       # submitted to a pipelined executor and not yet collected
    peak_batches_in_flight: int = 0  # the most at once since start (1 when one step runs at a time)
    spec_proposed_tokens: int = 0    # speculative guesses verified (0 when speculation is off)
    spec_accepted_tokens: int = 0    # of those, the ones that stood
    spec_steps: int = 0              # sequence-steps that verified guesses
    spec_emitted_tokens: int = 0     # tokens those sequence-steps emitted
    kv_handoffs: int = 0             # prefilled requests taken from another engine (add_prefilled)
    kv_handoff_bytes: int = 0        # their K/V bytes
    kv_handoff_seconds: float = 0.0  # summed wall-clock time from the prefill engine reading each out to here
    extra: dict = field(default_factory=dict)

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted_tokens / self.spec_proposed_tokens if self.spec_proposed_tokens else 0.0

    @property
    def spec_tokens_per_step(self) -> float:
        return self.spec_emitted_tokens / self.spec_steps if self.spec_steps else 1.0


class LLMEngine:
    def __init__(self, engine: EngineDir, options: EngineOptions = EngineOptions(), executor: Executor | None = None):
        self.engine = engine
        self.options = options
        manifest = engine.manifest
        self.limits = _lowered(manifest.limits, options)
        self.block_size = manifest.block_size
        if options.num_threads:
            torch.set_num_threads(options.num_threads)
        elif torch.get_num_threads() > usable_cpus():  # a CPU quota below the CPUs torch counts
            torch.set_num_threads(usable_cpus())
        self.tokenizer = Tokenizer.from_file(str(engine.path / "tokenizer.json"))
        self.tokenizer_config = _read_json(engine.path / "tokenizer_config.json")
        self.generation_config = _read_json(engine.path / "generation_config.json")
        self.special_tokens = manifest.special_tokens or from_tokenizer(self.tokenizer_config, self.tokenizer)
        self.eos_token_ids = manifest.eos_token_ids
        self.grammars = Grammars(self.tokenizer, self.eos_token_ids)
        if executor is None:
            backend = engine.backend or check_target(engine.path, manifest, options.backend)
            engine = self.engine = for_host(engine, backend, options.activations)
            executor = create_executor(engine, 0, kv_groups(manifest, backend, options.kv_cache_gib), backend,
                                       options.num_threads)
        self.executor = executor
        self.max_in_flight = executor.max_in_flight
        self.kv_groups = executor.cache.groups
        self.num_blocks = executor.cache.num_blocks
        self.speculator = self._speculator(options)
        windows, pools = self.kv_groups.windows, self.kv_groups.num_blocks
        self.scheduler = Scheduler(SchedulerConfig(
            max_batch_size=self.limits.max_batch_size, max_num_tokens=self.limits.max_num_tokens,
            max_seq_len=self.limits.max_seq_len, num_blocks=pools[0], block_size=self.block_size,
            enable_prefix_caching=options.enable_prefix_caching, max_batches_in_flight=self.max_in_flight,
            prefill_chunk=options.prefill_chunk, kv_windows=windows, window_blocks=pools[-1] if len(pools) > 1 else 0),
            self.eos_token_ids, self.speculator)
        self.scheduler.before_free = self._read_handoff
        self.sampler = getattr(executor, "sampler", None) or Sampler()  # a GPU executor may sample on its device
        self.requests: dict[str, _Request] = {}
        self.in_flight: deque[tuple[ScheduledBatch, object]] = deque()  # submitted batches, oldest first
        self.peak_in_flight = 0
        self._ids = itertools.count()
        self.prompt_tokens = self.generated_tokens = 0
        self.handoffs = [0, 0, 0.0]  # taken by add_prefilled: count, bytes, seconds (EngineStats.kv_handoff_*)

    def _speculator(self, options: EngineOptions) -> Speculator | None:
        config = options.speculative
        if config is None:
            return None
        if config.proposer == "ngram":
            return Speculator(config, NgramProposer(config.ngram_min, config.ngram_max))

        return Speculator(config, DraftProposer(config.draft_engine, self.engine, num_threads=options.num_threads))

    @classmethod
    def from_dir(cls, path: str | Path, options: EngineOptions = EngineOptions()) -> LLMEngine:
        return cls(open_engine(path, world_size=None, check_hashes=options.check_hashes, backend=options.backend),
                   options)

    # ------------------------------------------------------------------ requests

    def encode(self, prompt: str) -> list[int]:
        """A raw text's token ids, with the special tokens the model's tokenizer puts around it (BOS)."""
        return self.special_tokens.apply(self.tokenizer.encode(prompt, add_special_tokens=False).ids)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, hand_off: bool = False) -> str:
        """Queue a request; ValueError (before it takes any KV blocks) if it can never run.

        hand_off: prefill only (disaggregated serving): the request ends at its first token, and its
        final output carries the prompt's K/V for a decode engine (output.kv_handoff)."""
        params = self._params(params)
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        vocab = self.engine.manifest.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        seq = Sequence(request_id, ids, dataclasses.replace(params, max_tokens=1) if hand_off else params)
        if params.grammar is not None:
            seq.constraint = self.grammars.constraint(params.grammar)  # GrammarError is a ValueError
        if hand_off:
            self.kv_layout  # noqa: B018 -- an engine that cannot hand K/V over says so before taking the request
            seq.hand_off = params.max_tokens > 1  # one token asked for: answered here, nothing to hand over
        self.scheduler.add(seq)
        self.requests[request_id] = _Request(seq, IncrementalDetokenizer(self.tokenizer, params.stop))
        self.prompt_tokens += len(ids)
        return request_id

    def add_prefilled(self, handoff, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a request another engine prefilled (its output.kv_handoff), to decode here from its second
        token on; ValueError if the handoff does not fit this engine or nothing is left to decode. Its
        outputs' token_ids and text include the first token; their deltas start after it (the prefill
        engine's output gave it)."""
        params = self._params(params)
        layout = self.kv_layout
        check_handoff(handoff, layout, self.engine.manifest.vocab_size)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        seq = Sequence(request_id, handoff.prompt_token_ids, params)
        seq.seed = handoff.seed
        self.scheduler.add_prefilled(seq, handoff.first_token, handoff.first_logprob,
                                     lambda s, start: write_kv(self.executor.cache, layout, self._layer_tables(s),
                                                               start, handoff))
        request = self.requests[request_id] = _Request(seq, IncrementalDetokenizer(self.tokenizer, params.stop))
        request.detok.update(seq.output_token_ids)  # the first token's text: the prefill engine's output gave it
        self.prompt_tokens += seq.num_prompt_tokens
        self.handoffs[0] += 1
        self.handoffs[1] += handoff.num_bytes
        self.handoffs[2] += max(0.0, time.time() - handoff.made_at) if handoff.made_at else 0.0
        return request_id

    def _params(self, params: SamplingParams | None) -> SamplingParams:
        params = params or SamplingParams()
        if params.min_tokens and not params.eos_token_ids:  # min_tokens holds back this model's EOS too
            params = dataclasses.replace(params, eos_token_ids=self.eos_token_ids)
        return params

    @functools.cached_property
    def kv_layout(self):
        """How this engine's cache holds K/V (runtime/core/disaggregation.py); EngineError if it cannot hand it over."""
        return cache_layout(self.executor.cache, self.block_size)

    def _read_handoff(self, seq: Sequence) -> None:
        k, v = read_kv(self.executor.cache, self.kv_layout, self._layer_tables(seq), seq.num_prompt_tokens)
        blocks = self.scheduler.block_manager.blocks_needed(seq.num_prompt_tokens)
        seq.kv_handoff = KVHandoff(list(seq.prompt_token_ids), seq.output_token_ids[0],
                                   seq.logprobs[0] if seq.logprobs else None, seq.seed, self.kv_layout, k, v,
                                   tuple(seq.block_table[:blocks]), time.time())

    def _layer_tables(self, seq: Sequence) -> list[list[int]]:
        return layer_tables(self.executor.cache, self.kv_layout, self.scheduler.block_manager.tables(seq))

    def abort(self, request_id: str) -> bool:
        """Stop a request now: it gives no more outputs, and its KV blocks are freed at once, or when
        its batch comes back if one is in flight. False if it is unknown or already finished."""
        self.requests.pop(request_id, None)
        return self.scheduler.abort(request_id) is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # ------------------------------------------------------------------ the step

    @property
    def context_len(self) -> int:
        """The longest sequence this engine runs: max_seq_len, within what the full layers' pool holds (a pool
        of windowed layers holds a window, whatever the sequence's length)."""
        if self.kv_groups.windows[0]:
            return self.limits.max_seq_len
        return min(self.limits.max_seq_len, self.num_blocks * self.block_size)

    def _step_metadata(self, batch: ScheduledBatch):
        return build_step_metadata(batch, self.block_size, len(self.kv_groups.windows))

    def step(self) -> list[RequestOutput]:
        """Run a batch and return its outputs: one step start to finish, or, with a pipelined
        executor, submit batches until max_in_flight are in flight and collect the oldest."""
        if self.max_in_flight > 1:
            return self._step_pipelined()
        started = time.perf_counter()
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        self.peak_in_flight = max(self.peak_in_flight, 1)
        outputs = self._complete(batch, lambda: self.executor.execute(self._step_metadata(batch)))
        if self.speculator is not None and batch.decodes_only:  # decodes only: what guesses are priced on
            self.speculator.observe_step(batch.num_tokens, time.perf_counter() - started)
        return outputs

    def _step_pipelined(self) -> list[RequestOutput]:
        while len(self.in_flight) < self.max_in_flight:
            batch = self.scheduler.schedule()  # from sequences in no batch in flight
            if batch.is_empty:
                break
            try:
                handle = self.executor.submit(self._step_metadata(batch))
            except Exception as exc:  # the batch's requests end, as in _complete
                return self._fail_batch(batch, exc)
            self.in_flight.append((batch, handle))
            self.peak_in_flight = max(self.peak_in_flight, len(self.in_flight))
        if not self.in_flight:
            return []
        batch, handle = self.in_flight.popleft()
        return self._complete(batch, lambda: self.executor.collect(handle))

    def _complete(self, batch: ScheduledBatch, run_batch) -> list[RequestOutput]:
        """Take a batch's logits from run_batch(), sample and record its tokens; its requests' outputs."""
        try:
            logits = run_batch()
            prompt_rows = batch.prompt_logprob_rows()
            if prompt_rows:  # their rows follow the sampling rows
                count = sum(c for _, _, c in prompt_rows)
                logits, extra = logits[:-count], logits[-count:]
                record_prompt_logprobs(prompt_rows, extra)
            if batch.is_speculative:
                tokens, logprobs = self.sampler.verify_batch(logits, batch.sampling_seqs, batch.sampling_proposals)
            else:
                tokens, logprobs = self.sampler.sample(logits, batch.sampling_seqs)
        except Exception as exc:  # a failing step ends its own requests (see _fail_batch)
            return self._fail_batch(batch, exc)
        before = sum(seq.num_output_tokens for seq in batch.sampling_seqs)
        self.scheduler.postprocess(batch, tokens, logprobs)
        for seq in batch.sampling_seqs:  # a complete grammar ends its sequence
            if seq.constraint is not None and seq.constraint.done and not seq.is_finished:
                self.scheduler.finish(seq, "stop")
        self.generated_tokens += sum(seq.num_output_tokens for seq in batch.sampling_seqs) - before
        outputs = []
        for seq in batch.sampling_seqs:
            request = self.requests.get(seq.request_id)
            if request is not None:
                outputs.append(self._output(request))
        return outputs

    def _fail_batch(self, batch: ScheduledBatch, exc: Exception) -> list[RequestOutput]:
        """A failing batch ends its own requests, never the engine, unless the engine itself is lost (a rank died)."""
        if getattr(exc, "fatal", False):
            raise exc
        log.error("step failed; ending its %d request(s)", len(batch.seqs), exc_info=exc)
        outputs = []
        for seq in batch.seqs:
            request = self.requests.pop(seq.request_id, None)
            self.scheduler.finish(seq, "abort")  # also those aborted while in flight
            if request is not None:
                outputs.append(RequestOutput(seq.request_id, "", request.detok.text, list(seq.output_token_ids),
                                             True, "error", seq.num_prompt_tokens, seq.num_cached_tokens,
                                             error=f"{type(exc).__name__}: {exc}"))
        return outputs

    def _output(self, request: _Request) -> RequestOutput:
        seq, detok = request.seq, request.detok
        handed_off = seq.hand_off and seq.finish_reason == "length"  # its text goes on on the decode engine
        delta = detok.update(seq.output_token_ids, final=seq.is_finished and not handed_off)
        if detok.stopped and not seq.is_finished:
            self.scheduler.finish(seq, "stop")
            delta += detok.update(seq.output_token_ids, final=True)
        if seq.is_finished:
            del self.requests[seq.request_id]
        return RequestOutput(
            request_id=seq.request_id, delta=delta, text=detok.text, token_ids=list(seq.output_token_ids),
            finished=seq.is_finished, finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens,
            **_logprob_fields(seq),
            num_proposed_tokens=seq.num_proposed_tokens, num_accepted_tokens=seq.num_accepted_tokens,
            kv_handoff=seq.kv_handoff)

    # ------------------------------------------------------------------ conveniences

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        return render_chat(self.tokenizer_config, messages, add_generation_prompt, tools)

    def stats(self) -> EngineStats:
        bm = self.scheduler.block_manager
        spec = self.speculator.stats if self.speculator is not None else None
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting), kv_usage=bm.usage,
            prefix_queries=bm.prefix_cache_queries, prefix_hits=bm.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions, prompt_tokens=self.prompt_tokens,
            generated_tokens=self.generated_tokens, batches_in_flight=len(self.in_flight),
            peak_batches_in_flight=self.peak_in_flight, kv_handoffs=self.handoffs[0],
            kv_handoff_bytes=self.handoffs[1], kv_handoff_seconds=self.handoffs[2],
            **({} if spec is None else dict(spec_proposed_tokens=spec.proposed_tokens,
                                            spec_accepted_tokens=spec.accepted_tokens, spec_steps=spec.spec_steps,
                                            spec_emitted_tokens=spec.emitted_tokens)))


def _logprob_fields(seq: Sequence) -> dict:
    """A RequestOutput's log-prob fields: plain floats, and the alternatives apart (sampling.Logprob's `top`)."""
    params, fields = seq.params, {}
    if params.logprobs:
        fields["logprobs"] = [float(lp) for lp in seq.logprobs]
        if params.top_logprobs:
            fields["top_logprobs"] = [lp.top for lp in seq.logprobs]
    if params.prompt_logprobs is not None:
        fields["prompt_logprobs"] = [None if lp is None else float(lp) for lp in seq.prompt_logprobs]
        fields["prompt_top_logprobs"] = [None if lp is None else lp.top for lp in seq.prompt_logprobs]
    return fields


def record_prompt_logprobs(rows: list[tuple[Sequence, int, int]], logits: torch.Tensor) -> None:
    """Each (seq, first position, count) of ScheduledBatch.prompt_logprob_rows with its logits rows, in order:
    the log-probs of prompt tokens first + 1 .. first + count appended to the seq's."""
    logits, at = logits.float().cpu(), 0
    for seq, first, count in rows:
        following = torch.tensor(seq.token_ids[first + 1:first + 1 + count])
        seq.prompt_logprobs.extend(token_logprobs(logits[at:at + count], following, seq.params.prompt_logprobs))
        at += count


def _lowered(plan_limits: PlanLimits, options: EngineOptions) -> PlanLimits:
    limits = {}
    for key in ("max_batch_size", "max_num_tokens", "max_seq_len"):
        wanted, allowed = getattr(options, key), getattr(plan_limits, key)
        if wanted is None:
            continue
        if not 1 <= wanted <= allowed:
            raise EngineError(f"{key}={wanted}: must be between 1 and the engine's plan limit "
                              f"{allowed}; rebuild with a larger [limits] {key} to go higher")
        limits[key] = wanted
    lowered = dataclasses.replace(plan_limits, **limits)
    if lowered.max_num_tokens < lowered.max_batch_size:
        lowered = dataclasses.replace(lowered, max_batch_size=lowered.max_num_tokens)
    return lowered


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
