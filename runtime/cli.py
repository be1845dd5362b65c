"""`engine-run`: load a Kiln engine and generate, serve or benchmark."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from runtime import cli_errors
from runtime.cli_hosts import MASTER_ADDR, MASTER_PORT, NNODES, NODE_RANK
from runtime.format.engine_format import EngineError

app = typer.Typer(
    add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help text is plain: brackets print as typed
    help="Run Kiln engines built by `engine-build`: offline generation, an OpenAI-compatible HTTP "
         "server, and benchmarks. One process per rank; in-flight batching over a paged KV cache.",
)

DEFAULT_ENGINE = Path("engines/smollm2-135m")

ENGINE_ARG = typer.Argument(str(DEFAULT_ENGINE), help="Engine directory written by `engine-build build`, or its URL "
                                                     "(http[s]://...: fetched once into Kiln's cache and checked).")


def fail(message: str) -> None:
    cli_errors.fail("engine-run", message)


one_line_errors = cli_errors.one_line_errors("engine-run", (EngineError, ValueError, OSError))


def engine_options(max_batch_size, max_num_tokens, max_seq_len, kv_cache_gib, threads, rank_timeout=60.0,
                   backend=None, prefill_chunk=None, speculative=None, draft=None, speculative_k=4,
                   adaptive_k=True, activations=None):
    from runtime.core.engine import DEFAULT_PREFILL_CHUNK, EngineOptions
    from runtime.core.speculative import SpeculativeConfig

    if prefill_chunk is not None and prefill_chunk < 0:
        fail(f"--prefill-chunk must be >= 0 (0: no limit), got {prefill_chunk}")
    chunk = DEFAULT_PREFILL_CHUNK if prefill_chunk is None else (prefill_chunk or None)
    spec = None
    if draft is not None and speculative not in (None, "draft"):
        fail(f"--draft runs the draft proposer; it cannot be combined with --speculative {speculative}")
    if speculative == "draft" and draft is None:
        fail("--speculative draft needs --draft ENGINE (a Kiln engine with the target's tokenizer)")
    if speculative not in (None, "off") or draft is not None:
        spec = SpeculativeConfig(proposer="draft" if draft is not None else speculative, max_k=speculative_k,
                                 adaptive=adaptive_k, draft_engine=None if draft is None else str(draft))
    return EngineOptions(max_batch_size=max_batch_size, max_num_tokens=max_num_tokens, max_seq_len=max_seq_len,
                         prefill_chunk=chunk, kv_cache_gib=kv_cache_gib, num_threads=threads,
                         rank_timeout=rank_timeout, backend=backend, speculative=spec, activations=activations)


def echo_activations(llm) -> None:
    """The activation path this host runs the engine with, and why (stderr), where it had a choice."""
    from runtime.backends.activations import describe

    line = describe(llm.engine)
    if line:
        typer.echo(line, err=True)


@app.callback()
def main() -> None:
    """Run Kiln engines: generate, serve, bench."""


MAX_BATCH = typer.Option(None, "--max-batch-size", help="Lower the plan's sequences per step.")
MAX_TOKENS_STEP = typer.Option(None, "--max-num-tokens", help="Lower the plan's tokens per step.")
PREFILL_CHUNK = typer.Option(None, "--prefill-chunk",
                             help="Prefill tokens per step while other requests decode, so that long prompts "
                                  "arriving do not stall the running streams (0: up to --max-num-tokens; "
                                  "default 64, but none for generate's batch of prompts, which streams none "
                                  "of them: its prompts all start as soon as the step budget allows).")
MAX_SEQ = typer.Option(None, "--max-seq-len", help="Lower the plan's prompt + output length limit.")
KV_GIB = typer.Option(None, "--kv-cache-gib", help="KV cache budget in GiB (default: the build's memory plan).")
THREADS = typer.Option(None, "--threads", help="CPU threads per rank (default: all cores).")
BACKEND = typer.Option(None, "--backend",
                       help="What runs the engine (runtime/backends): cpu (cpu engines), cuda (cuda engines, on a GPU "
                            "of their compute capability; KILN_CUDA_INTERPRET=1 runs their kernels in Triton's "
                            "interpreter, for tests), tensorrt (tensorrt engines, on their GPU), or onnxruntime (a "
                            "tensorrt engine's verified ONNX on this CPU, KV budget 1 GiB unless --kv-cache-gib). "
                            "Default: the engine target's own.")
SPECULATIVE = typer.Option(None, "--speculative",
                            help="Speculative decoding: ngram (guess a sequence's next tokens from where its last "
                                 "few tokens occurred before in it: strong when answers copy their input), draft "
                                 "(with --draft), or off (the default). Answers stay the same: greedy ones, and "
                                 "sampled ones for a given seed.")
DRAFT = typer.Option(None, "--draft",
                     help="Speculate with this Kiln engine as the draft model (one rank, cpu target, the same "
                          "tokenizer as the engine); implies --speculative draft.")
SPECULATIVE_K = typer.Option(4, "--speculative-k", min=1, max=16,
                             help="Most guesses a sequence verifies per step; each sequence then guesses as many "
                                  "as its recent acceptance and the step's cost make worth it (0 when none are).")
ADAPTIVE_K = typer.Option(True, "--adaptive-k/--fixed-k",
                          help="--fixed-k: every sequence guesses --speculative-k tokens whenever the proposer has "
                               "them, whatever they cost (to measure acceptance, or where guesses are nearly free).")
ACTIVATIONS = typer.Option(None, "--activations",
                           help="cpu engines: the activation path of the int4/int8 linears, one the build's accuracy "
                                "gate allowed (`engine-build inspect` lists them). Default: the fastest allowed path, "
                                "timed on this host at start-up (a second or so, then cached per host and engine).")
RANK_TIMEOUT = typer.Option(60.0, "--rank-timeout",
                            help="Multi-rank engines: seconds a dead or hung rank is given before every rank "
                                 "stops and engine-run exits naming it. Ranks: one process each, started here, "
                                 "or by `torchrun --nproc-per-node N -m runtime.cli generate ...`.")


@app.command()
@one_line_errors
def generate(
    engine: str = ENGINE_ARG,
    prompt: list[str] = typer.Option(..., "--prompt", "-p", help="Prompt text (repeat for a batch)."),
    chat: bool = typer.Option(False, "--chat", help="Wrap each prompt as a user message in the chat template."),
    max_tokens: int = typer.Option(128, "--max-tokens", help="Tokens to generate per prompt."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass in (0, 1]."),
    top_k: int = typer.Option(-1, "--top-k", help="Sample among the k likeliest tokens (-1 = off)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Per-request seed: same seed, same text."),
    stop: Optional[list[str]] = typer.Option(None, "--stop", help="Stop string (repeatable)."),
    max_batch_size: Optional[int] = MAX_BATCH, max_num_tokens: Optional[int] = MAX_TOKENS_STEP,
    prefill_chunk: Optional[int] = PREFILL_CHUNK,
    max_seq_len: Optional[int] = MAX_SEQ, kv_cache_gib: Optional[float] = KV_GIB,
    threads: Optional[int] = THREADS, rank_timeout: float = RANK_TIMEOUT, backend: Optional[str] = BACKEND,
    speculative: Optional[str] = SPECULATIVE, draft: Optional[Path] = DRAFT, speculative_k: int = SPECULATIVE_K,
    adaptive_k: bool = ADAPTIVE_K,
    activations: Optional[str] = ACTIVATIONS,
    nnodes: int = NNODES, node_rank: int = NODE_RANK, master_addr: Optional[str] = MASTER_ADDR,
    master_port: int = MASTER_PORT,
):
    """Generate text for one or more prompts, streaming it to the terminal as it is produced."""
    from runtime.backends.fetch import local_engine
    from runtime.launcher import host_group, open_llm_engine
    from runtime.core.sampling import SamplingParams

    engine = Path(local_engine(engine))
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, max_tokens=max_tokens,
                            stop=tuple(stop or ()))
    if prefill_chunk is None and len(prompt) > 1:
        prefill_chunk = 0  # a batch streams nothing: no decode waits on a step's time, only the whole batch's
    options = engine_options(max_batch_size, max_num_tokens, max_seq_len, kv_cache_gib, threads, rank_timeout,
                             backend, prefill_chunk, speculative, draft, speculative_k, adaptive_k, activations)
    nodes = host_group(nnodes, node_rank, master_addr, master_port, engine, options)
    with open_llm_engine(engine, options, nodes) as llm:
        echo_activations(llm)
        texts = [llm.apply_chat_template([{"role": "user", "content": p}]) if chat else p for p in prompt]
        ids = [llm.add_request(t, params) for t in texts]
        stream = len(ids) == 1
        final = {}
        while len(final) < len(ids):
            for out in llm.step():
                if stream:
                    sys.stdout.write(out.delta)
                    sys.stdout.flush()
                if out.finished:
                    final[out.request_id] = out
                    if out.finish_reason == "error":
                        fail(f"request failed: {out.error}")
        if stream:
            sys.stdout.write("\n")
        else:
            for i, rid in enumerate(ids):
                typer.echo(f"--- [{i}] {prompt[i]!r}\n{final[rid].text}")


@app.command()
@one_line_errors
def serve(
    engines: Optional[list[str]] = typer.Argument(
        None, metavar="ENGINE | NAME=ENGINE",
        help="Engine directories to serve, each under its manifest's model name or NAME (default: "
             f"{DEFAULT_ENGINE} when no --fleet)."),
    fleet_file: Optional[Path] = typer.Option(None, "--fleet", metavar="FILE",
                                              help="A fleet file (TOML): models by name with their engines, "
                                                   "replicas and threads, and tiers (\"model\": \"auto\") that "
                                                   "escalate from a cheap model to a stronger one. See docs/fleets.md."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: all interfaces)."),
    port: int = typer.Option(8000, "--port", help="TCP port."),
    max_waiting: int = typer.Option(64, "--max-waiting", min=1,
                                    help="Requests that may wait for a batch slot; more get 429 + Retry-After."),
    drain_timeout: float = typer.Option(30.0, "--drain-timeout", min=0.0,
                                        help="On SIGTERM, seconds running requests get to finish before abort."),
    model_name: Optional[str] = typer.Option(None, "--model-name",
                                             help="Model id clients send, for one engine (default: the manifest's "
                                                  "model name)."),
    max_request_bytes: int = typer.Option(
        1 << 20, "--max-request-bytes", min=1,
        help="Largest request body in bytes; a larger one gets 413 before it is read. The default, 1 MiB, is "
             "512 bytes per token of the default plan's max_seq_len (2048): a prompt that fits the context (~4 "
             "bytes a token as English text, at most ~12 as token ids or \\u-escaped text) fits many times over."),
    max_batch_size: Optional[int] = MAX_BATCH, max_num_tokens: Optional[int] = MAX_TOKENS_STEP,
    prefill_chunk: Optional[int] = PREFILL_CHUNK,
    max_seq_len: Optional[int] = MAX_SEQ, kv_cache_gib: Optional[float] = KV_GIB,
    threads: Optional[int] = THREADS, rank_timeout: float = RANK_TIMEOUT, backend: Optional[str] = BACKEND,
    speculative: Optional[str] = SPECULATIVE, draft: Optional[Path] = DRAFT, speculative_k: int = SPECULATIVE_K,
    adaptive_k: bool = ADAPTIVE_K,
    activations: Optional[str] = ACTIVATIONS,
    replicas: int = typer.Option(1, "--replicas", min=1,
                                 help="Engine replicas behind the one endpoint, each its own rank processes, run "
                                      "on Ray Serve (pip install 'kiln[serve]'); 1 serves from this process."),
    max_replicas: Optional[int] = typer.Option(None, "--max-replicas",
                                               help="Autoscale between --replicas and this many replicas on "
                                                    "requests in flight."),
    routing: str = typer.Option("prefix", "--routing",
                                help="Replicas: prefix (send a request where its prompt's leading blocks are "
                                     "likely cached, unless that replica is 4 requests busier than the least "
                                     "busy) or round-robin."),
    disaggregate: Optional[str] = typer.Option(None, "--disaggregate", metavar="P:D",
                                               help="Prefill/decode disaggregation on Ray Serve: P prefill workers "
                                                    "compute prompts and hand their K/V to D decode workers, "
                                                    "which stream the answers (one-rank cpu engines)."),
    spread: bool = typer.Option(False, "--spread",
                                help="Replicas: at most one on each node of the Ray cluster (Serve's "
                                     "max_replicas_per_node), so that a host lost takes one replica."),
    ray_address: Optional[str] = typer.Option(None, "--ray-address",
                                              help="Replicas: run on this Ray cluster (e.g. auto, ray://head:10001) "
                                                   "instead of a Ray instance started here; give the engine as a "
                                                   "path every node holds, or as its URL (each node fetches it)."),
    api_key: Optional[list[str]] = typer.Option(None, "--api-key",
                                                help="A key clients must send (Authorization: Bearer KEY) on /v1 and "
                                                     "/metrics; repeatable. Also KILN_API_KEY. None: open to all."),
    api_key_file: Optional[Path] = typer.Option(None, "--api-key-file",
                                                help="Keys one a line (# comments), each optionally followed by "
                                                     "name=N rpm=R tpm=T; read again on SIGHUP, without dropping "
                                                     "running streams."),
    key_rpm: int = typer.Option(0, "--key-rpm", min=0,
                                help="Requests per minute each API key may send, unless its line says (rpm=); "
                                     "more get 429 + Retry-After. 0: no limit."),
    key_tpm: int = typer.Option(0, "--key-tpm", min=0,
                                help="Tokens per minute (prompt + generated) each API key may use, unless its "
                                     "line says (tpm=). 0: no limit."),
    metrics_open: bool = typer.Option(False, "--metrics-open",
                                      help="Serve /metrics without a key while /v1 requires one."),
    nnodes: int = NNODES, node_rank: int = NODE_RANK, master_addr: Optional[str] = MASTER_ADDR,
    master_port: int = MASTER_PORT,
):
    """Serve engines over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models)."""
    import dataclasses

    from runtime.backends import open_engine
    from runtime.launcher import host_group, open_llm_engine
    from runtime.serving.app import serve as run_server
    from runtime.serving.auth import ApiKeys, KeyFileError
    from runtime.serving.fleet import ReplicaPlan, from_arguments, load_fleet

    sources: dict[str, str] = {}  # a fetched engine's local copy -> its URL (Ray replicas fetch it themselves)
    engines = [fetched_argument(item, sources) for item in engines or ()] or None
    if disaggregate is not None and replicas != 1:
        fail("--disaggregate P:D sets the workers; leave out --replicas")
    if fleet_file is not None:
        if engines or model_name is not None:
            fail("--fleet names the engines and their model names; leave out ENGINE and --model-name")
        if (replicas != 1 or max_replicas is not None or disaggregate is not None or routing != "prefix" or spread
                or (nnodes != 1 and ray_address is not None)):
            fail("with --fleet, replicas, max_replicas, disaggregate, routing, spread and nnodes go in the fleet file, "
                 "per model")
        fleet = load_fleet(fleet_file)
    else:
        placed = nnodes if ray_address is not None else 1  # Ray places each replica's hosts
        if placed > 1 and (node_rank or master_addr):
            fail("with --ray-address, Ray places each replica's --nnodes hosts; leave out --node-rank and "
                 "--master-addr")
        try:
            plan = (ReplicaPlan.disaggregated(disaggregate, max_replicas=max_replicas, routing=routing, spread=spread,
                                              nnodes=placed) if disaggregate is not None else
                    ReplicaPlan(replicas=replicas, max_replicas=max_replicas, routing=routing, spread=spread,
                                nnodes=placed))
        except ValueError as exc:
            fail(str(exc))
        fleet = from_arguments(engines or [str(DEFAULT_ENGINE)], model_name, plan)
    # Refuse a bad engine or a taken port before anything listens: the files' hashes are checked
    # here once, not again by the ranks.
    world = sum(open_engine(model.engine, backend=model.backend or backend).manifest.world_size
                for model in fleet.models)  # every engine's ranks
    check_port_free(host, port)
    try:
        keys = ApiKeys(api_key, api_key_file, rpm=key_rpm or None, tpm=key_tpm or None)
    except KeyFileError as exc:
        fail(str(exc))
    options = engine_options(max_batch_size, max_num_tokens, max_seq_len, kv_cache_gib, threads, rank_timeout,
                             backend, prefill_chunk, speculative, draft, speculative_k, adaptive_k, activations)
    options = dataclasses.replace(options, check_hashes=False)
    if nnodes > 1 and ray_address is None and (len(fleet.models) != 1 or fleet.on_ray):
        fail("--nnodes without --ray-address spreads one engine's ranks over hosts you start it on: one engine, "
             "without replicas or --fleet (with --ray-address, Ray places each replica's hosts)")
    nodes = (host_group(nnodes, node_rank, master_addr, master_port, str(fleet.models[0].engine), options)
             if ray_address is None else None)
    server = {"max_waiting": max_waiting, "max_request_bytes": max_request_bytes, "metrics_open": metrics_open}
    if fleet.on_ray or ray_address is not None:
        try:
            import ray.serve  # noqa: F401

            from runtime.serving.replicas import serve_replicas
        except ImportError as exc:
            fail(f"replicas and --disaggregate run on Ray Serve ({exc}): pip install 'kiln[serve]'")
        raise typer.Exit(serve_replicas(fleet, options, host=host, port=port, drain_timeout=drain_timeout,
                                        ray_address=ray_address, keys=keys if keys.enabled else None,
                                        sources=sources, **server))
    from runtime.backends.cpu.cpus import usable_cpus
    from runtime.serving.fleet import model_options

    # several engines and no --threads: the host's cores shared between their ranks
    shared = max(1, usable_cpus() // world) if options.num_threads is None and len(fleet.models) > 1 else None
    opened = {}
    for model in fleet.models:
        chosen = model_options(model, options)
        if shared is not None and model.threads is None:
            chosen = dataclasses.replace(chosen, num_threads=shared)
        opened[model.name] = (lambda path=str(model.engine), chosen=chosen: open_llm_engine(path, chosen, nodes))
    raise typer.Exit(run_server(opened, tiers=fleet.tiers, host=host, port=port, drain_timeout=drain_timeout,
                                keys=keys if keys.enabled else None, **server))


def fetched_argument(item: str, sources: dict[str, str]) -> str:
    """A serve ENGINE or NAME=ENGINE argument with a URL engine replaced by its local copy (runtime/backends/fetch),
    noted in sources."""
    from runtime.backends.fetch import is_url, local_engine

    name, _, engine = item.partition("=") if "=" in item and not is_url(item) else ("", "", item)
    local = local_engine(engine)
    if local != engine:
        sources[local] = engine
    return f"{name}={local}" if name else local


def check_port_free(host: str, port: int) -> None:
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            probe.bind((host, port))
        except OSError as exc:
            fail(f"cannot listen on {host}:{port}: {exc.strerror or exc} (another server? choose --port)")


@app.command()
@one_line_errors
def bench(
    engine: str = ENGINE_ARG,
    concurrency: list[int] = typer.Option([1, 8, 32], "--concurrency", "-c", min=1,
                                          help="Requests in flight at a time; repeat for several levels."),
    requests: Optional[int] = typer.Option(None, "--requests", min=1,
                                           help="Requests per level (default: 2 x the concurrency, at least 8)."),
    prompt_len: int = typer.Option(128, "--prompt-len", min=1, help="Prompt tokens per request (synthetic)."),
    output_len: int = typer.Option(128, "--output-len", min=2, help="Output tokens per request (EOS ignored)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the figures as JSON to this file."),
    plot_out: Optional[Path] = typer.Option(None, "--plot",
                                            help="Also draw throughput and latency against concurrency into "
                                                 "this PNG (needs matplotlib: the bench extra)."),
    roofline: bool = typer.Option(True, "--roofline/--no-roofline",
                                  help="Measure this machine's read bandwidth and f32/int8 peaks first (a few "
                                       "seconds) and show each level's share of them and the limit that applies."),
    max_batch_size: Optional[int] = MAX_BATCH, max_num_tokens: Optional[int] = MAX_TOKENS_STEP,
    prefill_chunk: Optional[int] = PREFILL_CHUNK,
    max_seq_len: Optional[int] = MAX_SEQ, kv_cache_gib: Optional[float] = KV_GIB,
    threads: Optional[int] = THREADS, rank_timeout: float = RANK_TIMEOUT, backend: Optional[str] = BACKEND,
    speculative: Optional[str] = SPECULATIVE, draft: Optional[Path] = DRAFT, speculative_k: int = SPECULATIVE_K,
    adaptive_k: bool = ADAPTIVE_K,
    activations: Optional[str] = ACTIVATIONS,
    busy_cores: int = typer.Option(0, "--busy-cores", min=0,
                                   help="Then run the levels again with this many busy-loop processes pinned to "
                                        "this process's last CPUs, and show each level's share of its quiet "
                                        "speed."),
    nnodes: int = NNODES, node_rank: int = NODE_RANK, master_addr: Optional[str] = MASTER_ADDR,
    master_port: int = MASTER_PORT,
):
    """Benchmark the engine offline: throughput, time to first token and inter-token latency per concurrency,
    with the weight bandwidth and linear operations each level achieves against this machine's measured
    peaks. Greedy, synthetic prompts; the table goes to stdout. With --busy-cores, the same levels again
    beside other processes' busy loops: how much speed survives a busy host."""
    import torch

    from runtime.backends.fetch import local_engine
    from runtime.measure import bench as b
    from runtime.launcher import host_group, open_llm_engine
    from runtime.measure.roofline import linear_parameters, measure_peaks

    engine = Path(local_engine(engine))
    if plot_out is not None:  # before minutes of benchmarking, not after
        b.require_matplotlib()
    try:
        spinning = b.BusyCores(busy_cores) if busy_cores else None
    except ValueError as exc:
        fail(str(exc))
    options = engine_options(max_batch_size, max_num_tokens, max_seq_len, kv_cache_gib, threads, rank_timeout,
                             backend, prefill_chunk, speculative, draft, speculative_k, adaptive_k, activations)
    nodes = host_group(nnodes, node_rank, master_addr, master_port, engine, options)
    with open_llm_engine(engine, options, nodes) as llm:
        echo_activations(llm)
        limit = llm.limits.max_seq_len
        if prompt_len + output_len > limit:
            fail(f"--prompt-len {prompt_len} + --output-len {output_len} exceeds the engine's max_seq_len {limit}")
        weights = b.weight_bytes(engine)
        manifest = llm.engine.manifest
        choice = llm.engine.activation_choice
        running = choice.activations if choice is not None else manifest.activations  # the path the peaks judge
        layer_params, head_params = linear_parameters(manifest.model_config)
        params = (layer_params // manifest.world_size, head_params // manifest.world_size)
        b.run_level(llm, 1, 1, min(8, prompt_len), 4, weights, seed=99)  # warm up: threads, caches, replay
        context = {"engine": str(engine), "threads": threads or torch.get_num_threads(), "backend": backend,
                   "prompt_len": prompt_len, "output_len": output_len, "weight_bytes_per_rank": weights,
                   "activations": running}
        peaks = None
        if roofline:
            typer.echo("  measuring this machine's peaks (read bandwidth, f32 and int8 matrix products) ...", err=True)
            peaks = measure_peaks(context["threads"])
            context["peaks"] = peaks.to_dict()
        typer.echo(f"engine {engine}  prompt {prompt_len}  output {output_len}  threads {context['threads']}  "
                   f"weights {weights / 1e6:.1f} MB per rank", err=True)

        def run_levels(seed: int, note: str = "") -> list:
            levels = []
            for level in concurrency:
                count = requests or max(8, 2 * level)
                typer.echo(f"  concurrency {level}{note}: {count} requests ...", err=True)
                levels.append(b.run_level(llm, level, count, prompt_len, output_len, b.StepReads(engine),
                                          seed=seed + level, linear_params=params))
            return levels

        results, busy = run_levels(0), []
        if spinning is not None:
            with spinning:  # fresh prompts (seeds), so the prefix cache gives the busy levels nothing
                busy = run_levels(1000, f", CPUs {spinning.cpus} busy")
            context["busy_cores"] = spinning.cpus
    if peaks is not None:
        b.annotate(results, peaks, running)
    typer.echo(b.table(results))
    if peaks is not None:
        typer.echo(f"peaks on {peaks.threads} threads: read {peaks.read_gbs:.1f} GB/s, f32 {peaks.f32_gflops:.0f} "
                   f"GFLOP/s, int8 {peaks.int8_gops:.0f} GOP/s, int16 {peaks.int16_gops:.0f} GOP/s; '% compute' is "
                   "against the peak of the engine's activations", err=True)
    if busy:
        if peaks is not None:
            b.annotate(busy, peaks, running)
        typer.echo(f"\nwith {busy_cores} busy-loop process(es) pinned to CPUs {context['busy_cores']}:")
        typer.echo(b.table(busy))
        typer.echo(f"\n{b.slowdown_table(results, busy)}")
    if json_out is not None:
        json_out.write_text(b.to_json(results, context, busy) + "\n")
    if plot_out is not None:
        b.plot(results, plot_out, f"{llm.engine.manifest.model_name}: prompt {prompt_len}, output {output_len}")
        typer.echo(f"plot: {plot_out}", err=True)


if __name__ == "__main__":
    sys.exit(app())
