"""The OpenAI API: /v1/models, and /v1/completions and /v1/chat/completions on one shared path, for every
model and tier behind the endpoint (fleet.py).

The two generation endpoints differ only in how a request becomes prompts and in the shapes of
their answers (an `Answer` each); admission, sampling parameters, streaming, disconnects and usage
are the same code. Prompts are read on a worker thread (prompts.py), never on the event loop.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from runtime.core.engine import LLMEngine, RequestOutput
from runtime.serving.answers import Answer, ChatAnswer, CompletionAnswer
from runtime.serving.engine_loop import ABORTED, EngineLoop, Overloaded
from runtime.serving.fleet import TierSpec
from runtime.serving.metrics import FrontMetrics
from runtime.serving.prompts import PromptReader, context_len
from runtime.serving.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    Usage,
)
from runtime.serving.quotas import KeyQuotas
from runtime.serving.request_params import checked_grammar, sampling_params
from runtime.serving.tokens import add_token_routes

DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there
TIER_HEADER = "x-kiln-tier"  # a tier request may name the tier's model to start on


class ClientGone(Exception):
    """The client of a non-streaming request disconnected; its requests were aborted."""


class _Run:
    """One HTTP request's engine requests (one per choice) and the queue their outputs arrive on."""

    def __init__(self, engine: EngineLoop, request_ids: list[str], outputs: asyncio.Queue):
        self.engine = engine
        self.index = {rid: i for i, rid in enumerate(request_ids)}
        self.unfinished = set(request_ids)
        self._outputs = outputs
        self.held: list[tuple[int, RequestOutput]] = []  # read already (a tier's probe): given out first

    async def outputs(self, request: Request | None = None):
        """(choice index, output) as they come; given the request, raises ClientGone once its client left."""
        while self.held:
            yield self.held.pop(0)
        next_check = time.monotonic() + DISCONNECT_POLL_S
        while self.unfinished:
            if request is not None and time.monotonic() >= next_check:
                next_check = time.monotonic() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    raise ClientGone()
            try:
                out = await asyncio.wait_for(self._outputs.get(), DISCONNECT_POLL_S if request else None)
            except TimeoutError:
                continue
            if out is ABORTED:
                self.unfinished.clear()
                raise APIError(503, "the server shut down before this request finished", type="unavailable")
            if out.finished:
                self.unfinished.discard(out.request_id)
                if out.finish_reason == "error":
                    raise APIError(500, f"generation failed: {out.error}", type="server_error")
            yield self.index[out.request_id], out

    async def final_outputs(self, request: Request) -> list[RequestOutput]:
        final = {}
        try:
            async for i, out in self.outputs(request):
                if out.finished:
                    final[i] = out
        finally:
            self.close()
        return [final[i] for i in range(len(self.index))]

    def close(self) -> None:
        """Abort what is still running (the client left, or a sibling choice failed)."""
        self.engine.abort(list(self.unfinished))


class _EventStream(StreamingResponse):
    """Server-sent events whose run is closed however the response ends (a client that left included)."""

    def __init__(self, events, run: _Run):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._run = run

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._run.close()


def _sse(payload: BaseModel | dict) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


async def _events(run: _Run, first: list[str], chunk_for, usage_for=None, charge=lambda finals: None):
    """SSE: `first`, then chunk_for(index, output, tokens sent before) per output, usage_for(finals), [DONE];
    charge(last outputs) however the stream ends."""
    for event in first:
        yield event
    sent = [0] * len(run.index)
    last: list[RequestOutput | None] = [None] * len(run.index)
    try:
        async for i, out in run.outputs():
            event = chunk_for(i, out, sent[i])
            sent[i], last[i] = len(out.token_ids), out
            if event:
                yield event
        if usage_for is not None:
            yield usage_for(last)
    except APIError as exc:
        yield _sse(exc.body())
    finally:
        charge(last)
    yield "data: [DONE]\n\n"


def _usage(prompt_lens: list[int], n: int, finals: list[RequestOutput | None]) -> Usage:
    completion = sum(len(o.token_ids) for o in finals if o is not None)
    cached = sum(o.num_cached_tokens for o in finals[::n] if o is not None)
    return Usage(prompt_tokens=sum(prompt_lens), completion_tokens=completion,
                 total_tokens=sum(prompt_lens) + completion, prompt_tokens_details={"cached_tokens": cached})


# ---------------------------------------------------------------------- the routes

def add_openai_routes(app: FastAPI, models: dict[str, EngineLoop], tiers: dict[str, TierSpec],
                      metrics: FrontMetrics, quotas: KeyQuotas) -> None:
    """The /v1 endpoints over every model (an EngineLoop, or a ReplicaPool with its interface) and tier;
    app.state.draining refuses new requests."""
    started = int(time.time())
    readers: dict[int, PromptReader] = {}

    def prompt_reader(llm: LLMEngine) -> PromptReader:  # on a worker thread: a new one reads the vocabulary
        reader = readers.get(id(llm))
        if reader is None or reader.llm is not llm:
            reader = readers[id(llm)] = PromptReader(llm)
        return reader

    def served() -> str:
        return ", ".join(map(repr, [*models, *tiers]))

    def ready(name: str) -> EngineLoop:
        pool = models[name]
        if not pool.ready:
            if pool.failure is not None:
                raise APIError(503, f"model {name!r} is not serving: its engine failed ({pool.failure})",
                               type="unavailable")
            raise APIError(503, f"model {name!r} is not loaded yet; retry when /health answers 200",
                           type="unavailable", headers={"Retry-After": "1"})
        return pool

    async def start(pool: EngineLoop, body, prompts: list[list[int]], answer: Answer, arrival: float,
                    probe: bool = False) -> _Run:
        """Submit body.n choices per prompt (choice index = prompt index * n + i); probe: with log-probs."""
        llm = pool.llm
        grammar = await checked_grammar(body, llm)
        requests = []
        for p, ids in enumerate(prompts):
            for i in range(body.n):
                max_tokens = (answer.max_tokens if answer.max_tokens is not None
                              else max(1, context_len(llm) - len(ids)))
                params = sampling_params(body, llm, i, max_tokens, answer.logprobs or probe, answer.top_logprobs,
                                         answer.prompt_logprobs, grammar)
                requests.append((f"{answer.rid}-{p * body.n + i}", ids, params))
        try:
            outputs = await pool.submit(requests, arrival, whole=not body.stream)
        except Overloaded:
            raise APIError(429, f"the server is at capacity ({pool.max_waiting} requests waiting); retry later",
                           type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"}) from None
        return _Run(pool, [rid for rid, _, _ in requests], outputs)

    async def read_prompts(answer: Answer) -> list[list[int]]:
        return await asyncio.to_thread(lambda: answer.prompts(prompt_reader(answer.llm)))

    async def on_one_model(name: str, body, request: Request, key, kind, rid: str, arrival: float):
        pool = ready(name)
        answer = kind(pool.llm, body, rid, int(time.time()), name)
        prompts = await read_prompts(answer)
        quotas.admit_prompt(key, body.n * sum(map(len, prompts)))
        return answer, prompts, await start(pool, body, prompts, answer, arrival)

    async def on_a_tier(tier: TierSpec, body, request: Request, key, kind, rid: str, arrival: float):
        """Start on the tier's cheapest model (or the one the X-Kiln-Tier header names); while a model is not
        the last, one that is not serving (its engine loading or failed), a prompt over max_prompt_tokens or a
        low-confidence start (its first probe_tokens tokens held back and judged) moves the request to the next
        model, restarted from the prompt."""
        chain = list(tier.models)
        wanted = request.headers.get(TIER_HEADER)
        if wanted is not None:
            if wanted not in chain:
                raise APIError(400, f"{TIER_HEADER}: {wanted!r} is not a model of tier {tier.name!r} "
                                    f"({', '.join(chain)})", param=TIER_HEADER)
            for skipped in chain[:chain.index(wanted)]:
                metrics.tier_escalations.labels(tier.name, skipped, "header").inc()
            chain = chain[chain.index(wanted):]
        charged = False
        for n, name in enumerate(chain):
            last = n == len(chain) - 1
            if not last and not models[name].ready:
                metrics.tier_escalations.labels(tier.name, name, "unavailable").inc()
                continue
            pool = ready(name)
            answer = kind(pool.llm, body, rid, int(time.time()), name)
            prompts = await read_prompts(answer)
            if not last and tier.max_prompt_tokens is not None and max(map(len, prompts)) > tier.max_prompt_tokens:
                metrics.tier_escalations.labels(tier.name, name, "prompt_length").inc()
                continue
            if not charged:  # the prompt counts once, on the first model that takes it
                quotas.admit_prompt(key, body.n * sum(map(len, prompts)))
                charged = True
            run = await start(pool, body, prompts, answer, arrival, probe=not last)
            if last:
                break
            try:
                sure = await confident(run, tier, request)
            except BaseException:
                run.close()
                raise
            if sure:
                break
            run.close()
            metrics.tier_escalations.labels(tier.name, name, "confidence").inc()
        metrics.tier_answers.labels(tier.name, name).inc()
        return answer, prompts, run

    async def generate(body, request: Request, kind: type[CompletionAnswer] | type[ChatAnswer]):
        arrival = time.monotonic()
        if app.state.draining:
            raise APIError(503, "the server is shutting down", type="unavailable")
        tier = tiers.get(body.model)
        if tier is None and body.model not in models:
            raise APIError(404, f"model {body.model!r} is not served here; this server serves {served()}",
                           param="model", code="model_not_found")
        body.check_supported()
        key = getattr(request.state, "api_key", None)  # auth.RequireApiKey's, when keys are configured
        quotas.admit_request(key)
        rid = f"{kind.id_prefix}-{uuid.uuid4().hex}"
        answer, prompts, run = await (on_a_tier(tier, body, request, key, kind, rid, arrival) if tier is not None
                                      else on_one_model(body.model, body, request, key, kind, rid, arrival))
        if key is not None:
            metrics.key_requests.labels(key.name, answer.model).inc()
        prompt_lens = [len(p) for p in prompts]

        def charge(finals) -> None:
            quotas.generated(key, sum(len(o.token_ids) for o in finals if o is not None))

        if body.stream:
            def chunk_for(i, out, sent):
                if out.delta or out.finished or answer.logprobs:
                    chunk = answer.chunk(i, out, sent)  # None: held back (tool calls are read when finished)
                    return _sse(chunk) if chunk is not None else None

            def usage_for(finals):
                return _sse(answer.usage_chunk(_usage(prompt_lens, body.n, finals)))

            include_usage = body.stream_options is not None and body.stream_options.include_usage
            first = [_sse(chunk) for chunk in answer.first_chunks()]
            return _EventStream(_events(run, first, chunk_for, usage_for if include_usage else None, charge), run)
        finals = await run.final_outputs(request)
        charge(finals)
        return answer.response(finals, _usage(prompt_lens, body.n, finals))

    def model_cards() -> list[ModelCard]:
        cards = [ModelCard(id=name, created=started, max_model_len=context_len(pool.llm))
                 for name, pool in models.items() if pool.ready]
        lengths = {card.id: card.max_model_len for card in cards}
        return cards + [ModelCard(id=tier.name, created=started, owned_by="kiln-tier",
                                  max_model_len=min(lengths.get(m, 0) for m in tier.models))
                        for tier in tiers.values() if all(m in lengths for m in tier.models)]

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        cards = model_cards()
        if not cards:
            raise APIError(503, "no engine is loaded yet", type="unavailable", headers={"Retry-After": "1"})
        return ModelList(data=cards)

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str) -> ModelCard:
        card = next((c for c in model_cards() if c.id == model_id), None)
        if card is None:
            if model_id in models or model_id in tiers:
                raise APIError(503, f"model {model_id!r} is not loaded yet", type="unavailable",
                               headers={"Retry-After": "1"})
            raise APIError(404, f"model {model_id!r} is not served here; this server serves {served()}",
                           param="model", code="model_not_found")
        return card

    add_token_routes(app, models, prompt_reader)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request):
        return await generate(body, request, CompletionAnswer)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await generate(body, request, ChatAnswer)


async def confident(run: _Run, tier: TierSpec, request: Request) -> bool:
    """Whether the cheap model is sure enough of its first tokens: for every choice, the mean (tier.confidence
    "min": the lowest) log-probability of its first tier.probe_tokens tokens (fewer if it finished sooner) at
    least tier.min_mean_logprob. The outputs read are held on the run, so a confident run replays them."""
    logprobs: dict[int, list[float]] = {}
    finished: set[int] = set()
    outputs = run.outputs(request)
    try:
        async for i, out in outputs:
            run.held.append((i, out))
            logprobs[i] = [lp for lp in (out.logprobs or [])[:tier.probe_tokens] if lp is not None]
            if out.finished:
                finished.add(i)
            if all(c in finished or len(logprobs.get(c, ())) >= tier.probe_tokens for c in run.index.values()):
                break
    finally:
        await outputs.aclose()
    score = min if tier.confidence == "min" else statistics.fmean
    return all(score(lps) >= tier.min_mean_logprob for lps in logprobs.values() if lps)
