"""The ingress side of `engine-run serve --replicas N` (runtime/serving/replicas.py): ReplicaPool, which gives
the API the EngineLoop interface over a Serve deployment's replicas, the ingress deployment, and what a replica
answers a request it did not start (Refused)."""


from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.backends import open_engine
from runtime.core.chat import render_chat
from runtime.core.constraints import Grammars
from runtime.core.engine import EngineOptions, RequestOutput, _read_json
from runtime.core.sampling import SamplingParams
from runtime.format.special_tokens import from_tokenizer
from runtime.serving.app import create_app
from runtime.serving.metrics import ServerMetrics
from runtime.serving.protocol import APIError

if TYPE_CHECKING:
    from runtime.serving.auth import ApiKeys

log = logging.getLogger("kiln.replicas")

from runtime.serving.replica_metrics import ReplicaMetrics


@dataclasses.dataclass(frozen=True)
class Refused:
    """A replica's answer to a request it did not start: what the client gets, unless another replica may
    take it (retry: the replica's engine is not serving)."""

    status: int
    message: str
    type: str
    param: str | None = None
    code: str | None = None
    retry: bool = False

    def error(self) -> APIError:
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        return APIError(self.status, self.message, self.type, self.param, self.code, headers)



# ------------------------------------------------------------------------------------------ ingress

class ModelFrontend:
    """What the API reads prompts with (LLMEngine's tokenizer, chat template, limits), without an engine:
    the files come from the engine directory, the KV pool's size from a replica."""

    def __init__(self, engine: str, options: EngineOptions, described: dict):
        from types import SimpleNamespace

        from tokenizers import Tokenizer

        self.engine = open_engine(engine, check_hashes=False, backend=options.backend)
        path = Path(engine)
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.tokenizer_config = _read_json(path / "tokenizer_config.json")
        self.generation_config = _read_json(path / "generation_config.json")
        self.special_tokens = self.engine.manifest.special_tokens or from_tokenizer(self.tokenizer_config,
                                                                                    self.tokenizer)
        self.eos_token_ids = self.engine.manifest.eos_token_ids
        self.grammars = Grammars(self.tokenizer, self.eos_token_ids)  # requests' grammars are checked here
        self.grammars.warm()
        self.block_size = described["block_size"]
        self.num_blocks = described["num_blocks"]
        self.context_len = described["context_len"]  # what prompts.context_len gives for the replica's engine
        self.limits = SimpleNamespace(max_seq_len=described["context_len"])

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        return render_chat(self.tokenizer_config, messages, add_generation_prompt, tools)


class ReplicaPool:
    """The ingress's side of the replicas, with the EngineLoop interface that api.py and app.py serve from."""

    RETRIES = 3  # a request no replica started is offered to another this many times

    def __init__(self, handle, frontend: ModelFrontend, max_waiting: int, metrics: ServerMetrics, prefill=None,
                 expected_replicas: int = 1):
        self.handle = handle.options(stream=True)
        self.prefill = prefill.options(stream=True) if prefill is not None else None  # disaggregated
        self.llm = frontend
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.expected_replicas = expected_replicas
        self._started = False
        self.failure: Exception | None = None
        self._calls: dict[str, asyncio.Task] = {}  # request id -> the task pumping its call's outputs

    @property
    def ready(self) -> bool:
        """Serving (/health 200) once the router has seen every replica the plan starts with; it stays so
        while Serve replaces one that dies."""
        if not self._started:
            from runtime.serving.ray_router import replica_figures

            self._started = len(replica_figures(self.metrics.model)) >= self.expected_replicas
        return self._started

    @property
    def num_unfinished(self) -> int:
        return len(self._calls)

    async def submit(self, requests: list[tuple[str, list[int], SamplingParams]], arrival: float,
                     whole: bool = False) -> asyncio.Queue:
        """whole: the client reads only the requests' final outputs (nothing streamed to it), so if their replica
        fails they may start again on another whatever they had produced; otherwise only those that had produced
        no token yet do."""
        outputs: asyncio.Queue = asyncio.Queue()
        last_token: dict[str, float] = {}
        handoffs = None
        if self.prefill is None:
            call = await self._start(self.handle, requests)
        else:  # prefill workers give the first token and the K/V; decode workers go on from there
            first = await self._prefill(requests)
            now = time.monotonic()
            decoding = []
            for request in requests:
                out = first[request[0]]
                done = out.finish_reason != "length" or request[2].max_tokens <= 1 or out.kv_handoff is None
                self._observe(out if done else dataclasses.replace(out, finished=False), now, arrival, last_token)
                outputs.put_nowait(dataclasses.replace(out, kv_handoff=None, finished=done,
                                                       finish_reason=out.finish_reason if done else None))
                if not done:
                    decoding.append(request)
            if not decoding:
                return outputs
            handoffs = {rid: first[rid].kv_handoff for rid, _, _ in decoding}
            # streamed: the client has its first token while a decode worker takes the K/V (in _pump); whole: a
            # decode worker that refuses it is the request's HTTP error
            call = await self._start(self.handle, decoding, handoffs=handoffs) if whole else None
            requests = decoding
        task = asyncio.get_running_loop().create_task(
            self._pump(call, requests, outputs, arrival, last_token, whole, handoffs))
        self._calls.update(dict.fromkeys((rid for rid, _, _ in requests), task))
        return outputs

    async def _prefill(self, requests) -> dict[str, RequestOutput]:
        """Each request's final output from a prefill worker: its first token, and its K/V to hand over."""
        call = await self._start(self.prefill, requests, hand_off=True)
        final: dict[str, RequestOutput] = {}
        try:
            async for batch in call:
                if isinstance(batch, Refused):
                    raise batch.error()
                final.update((out.request_id, out) for out in batch if out.finished)
        except asyncio.CancelledError:
            call.cancel()
            raise
        except APIError:
            raise
        except Exception as exc:
            raise APIError(500, f"generation failed: the prefill worker running it failed ({type(exc).__name__})",
                           type="server_error") from None
        errors = [out.error for out in final.values() if out.finish_reason == "error"]
        if errors:
            raise APIError(500, f"generation failed: {errors[0]}", type="server_error")
        return final

    async def _start(self, handle, requests, **kwargs):
        """A streaming generate call that a replica has started (its first item, [], consumed); a replica
        that refuses for want of an engine, or dies before answering, passes the request to another."""
        refused = None
        for _ in range(self.RETRIES):
            call = handle.generate.remote(requests, token_ids=requests[0][1], **kwargs)
            try:
                first = await call.__anext__()
            except asyncio.CancelledError:
                call.cancel()
                raise
            except Exception as exc:  # the replica died before answering: nothing started
                log.warning("a replica failed before starting a request (%s); trying another", exc)
                refused = Refused(503, f"no replica could take the request: {type(exc).__name__}", "unavailable")
                continue
            if isinstance(first, Refused):
                refused = first
                if first.retry:
                    continue
                raise first.error()
            break
        else:
            raise refused.error()
        return call

    async def _pump(self, call, requests, outputs: asyncio.Queue, arrival: float, last_token: dict, whole: bool,
                    handoffs: dict | None) -> None:
        """The call's outputs into the queue (a call of None: a disaggregated request's decode call, started
        here). If its replica dies (or shuts down) mid-call, the requests that can
        start again (whole ones, and any that had no token yet) go to another replica, up to RETRIES times; the
        others end in an error saying so."""
        pending = {request[0]: request for request in requests}  # not finished yet
        emitted: set[str] = set()  # have queued a token: a streaming client has seen it
        try:
            if call is None:  # disaggregated and streamed: the decode call starts here
                try:
                    call = await self._start(self.handle, requests, handoffs=handoffs)
                except APIError as refused:
                    self._fail(list(pending), refused, outputs, f"no decode worker took it: {refused.message}")
                    return
            for attempt in range(self.RETRIES + 1):
                try:
                    async for batch in call:
                        if isinstance(batch, Refused):
                            raise batch.error()
                        now = time.monotonic()
                        for out in batch:
                            self._observe(out, now, arrival, last_token)
                            outputs.put_nowait(out)
                            if out.token_ids:
                                emitted.add(out.request_id)
                            if out.finished:
                                pending.pop(out.request_id, None)
                    return
                except asyncio.CancelledError:
                    call.cancel()
                    raise
                except Exception as exc:  # the replica died mid-call, or shut down
                    again = [r for rid, r in pending.items() if whole or rid not in emitted]
                    self._fail([rid for rid in pending if not whole and rid in emitted], exc, outputs)
                    if not again or attempt == self.RETRIES:
                        self._fail([r[0] for r in again], exc, outputs)
                        return
                    log.warning("a replica failed %d running request(s) (%s); %d start again on another",
                                len(pending), exc, len(again))
                    pending = {r[0]: r for r in again}
                    for rid in pending:
                        last_token.pop(rid, None)
                    kept = {"handoffs": {rid: handoffs[rid] for rid in pending}} if handoffs else {}
                    try:
                        call = await self._start(self.handle, again, **kept)
                    except APIError as refused:
                        self._fail(list(pending), refused, outputs)
                        return
                    self.metrics.requests_restarted.inc(len(again))
        finally:
            for request in requests:
                self._calls.pop(request[0], None)

    def _fail(self, ids: list[str], exc: Exception, outputs: asyncio.Queue, error: str | None = None) -> None:
        for rid in ids:
            outputs.put_nowait(RequestOutput(rid, "", "", [], True, "error", 0, 0,
                                             error=error or f"the replica running it failed ({type(exc).__name__})"))
            self.metrics.requests_finished.labels("error").inc()
        if ids:
            log.warning("a replica failed %d running request(s): %s", len(ids), exc)

    def _observe(self, out: RequestOutput, now: float, arrival: float, last_token: dict) -> None:
        """Latency and token metrics; last_token: request id -> when its latest token came."""
        if out.finish_reason != "error" and out.token_ids:
            last = last_token.get(out.request_id)
            if last is None:
                self.metrics.time_to_first_token.observe(now - arrival)
            else:
                self.metrics.inter_token_latency.observe(now - last)
            last_token[out.request_id] = now
        if out.finished:
            self.metrics.requests_finished.labels(out.finish_reason).inc()
            self.metrics.prompt_tokens.inc(out.num_prompt_tokens)
            self.metrics.generation_tokens.inc(len(out.token_ids))
            self.metrics.spec_proposed.inc(out.num_proposed_tokens)
            self.metrics.spec_accepted.inc(out.num_accepted_tokens)

    def abort(self, request_ids: list[str]) -> None:
        for task in {self._calls[rid] for rid in request_ids if rid in self._calls}:
            task.cancel()

    def abort_all(self) -> None:
        self.abort(list(self._calls))


class KilnIngress:
    """The HTTP front (Serve's ingress deployment): create_app over a ReplicaPool per model, with the fleet's
    tiers, API keys and limits. reload_keys() reads the key file again (the driver calls it on SIGHUP)."""

    async def __init__(self, deployments: dict[str, dict], tiers: tuple = (), max_waiting: int = 64,
                       max_request_bytes: int = 1 << 20, keys: ApiKeys | None = None, metrics_open: bool = False):
        self.pools = {}
        for name, d in deployments.items():
            described = await d["replicas"].describe.remote()
            if d.get("prefill") is not None:
                await d["prefill"].describe.remote()  # both routers know their replicas from here on
            frontend = ModelFrontend(d["engine"], d["options"], described)
            self.pools[name] = ReplicaPool(d["replicas"], frontend, max_waiting, ReplicaMetrics(name),
                                           d.get("prefill"), d["expected_replicas"])
        self.keys = keys  # auth.ApiKeys (pickled here whole, its key file path absolute), or None
        self.tiers, self.max_request_bytes, self.metrics_open = tiers, max_request_bytes, metrics_open

    def reload_keys(self) -> int:
        """Read the key file again; the number of keys now accepted."""
        if self.keys is None:
            return 0
        self.keys.reload()
        return len(self.keys.keys)

    def __serve_build_asgi_app__(self):
        return create_app(self.pools, self.tiers, self.max_request_bytes, self.keys, self.metrics_open)


