"""A bounded mixed load on one endpoint serving two models, with bad input mixed in and a replica killed mid-run.

    python benchmarks/fleet_load.py --a ENGINE --b ENGINE [--duration 120] [--kill-at 40] [--concurrency 6]
        [--out /tmp/kiln-fleet-load]

`engine-run serve --fleet` (loopback only) serves model "a" from 2 Ray Serve replicas and model "b" from one,
and the tier "auto" (a first, b when a's first 8 tokens have a mean log-probability under -0.6), behind API
keys: alice and carol without limits, bob at --bob-rpm requests a minute. --concurrency clients send requests
back to back for --duration seconds: streamed and not, to either model or the tier, under the three keys; about
one in ten carries a wrong or missing key and one in ten a malformed body (not JSON, a missing field, a wrong
type). At --kill-at seconds the replica of a the router favours (most requests running, then most routed) is killed
(SIGKILL of its process).
The report gives requests served, refused by reason, failed (and whether each failure was in flight on model a
or the tier when the replica died), and latency p50 / p99 per model; --out gets every request as JSON lines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from tier_check import start_server  # noqa: E402

KEYS = {"alice": "alice-key", "bob": "bob-key", "carol": "carol-key"}
MESSAGES = ["Name three colours.", "What is the capital of France?", "Write a haiku about rain.",
            "Explain what a CPU does in one sentence.", "Count from one to ten.", "Give me a tip for sleeping well."]


def replica_figures(url: str, model: str) -> dict[str, dict[str, float]]:
    """kiln_replica_* gauges of one model's replicas: replica id -> {figure: value}."""
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEYS['alice']}"}, timeout=10).text
    figures: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if line.startswith("kiln_replica_") and "{" in line:
            name, _, rest = line[len("kiln_replica_"):].partition("{")
            labels = dict(re.findall(r'(\w+)="([^"]*)"', rest))
            if labels.get("model") == model and "replica" in labels and "gpu" not in labels:
                figures.setdefault(labels["replica"], {})[name] = float(line.split()[-1])
    return figures


def one_request(rng: random.Random) -> dict:
    """What a client sends next: {kind, model, stream, key, body or raw}."""
    roll = rng.random()
    model = rng.choice(["a", "a", "b", "b", "auto"])
    key = rng.choice(list(KEYS))
    body = {"model": model, "messages": [{"role": "user", "content": rng.choice(MESSAGES)}],
            "max_tokens": rng.randint(8, 40), "temperature": 0, "stream": rng.random() < 0.5}
    if roll < 0.05:
        return {"kind": "bad_key", "model": model, "key": None, "body": body}
    if roll < 0.10:
        return {"kind": "bad_key", "model": model, "key": "wrong", "body": body}
    if roll < 0.14:
        return {"kind": "malformed", "model": model, "key": key, "raw": b'{"model": "a", "messages": [}'}
    if roll < 0.17:
        return {"kind": "malformed", "model": model, "key": key, "body": {"model": model}}
    if roll < 0.20:
        return {"kind": "malformed", "model": model, "key": key, "body": {**body, "max_tokens": "many"}}
    return {"kind": "good", "model": model, "key": key, "body": body}


async def send(http: httpx.AsyncClient, request: dict) -> dict:
    key = KEYS.get(request["key"], request["key"])
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    started = time.monotonic()
    result = {"kind": request["kind"], "model": request["model"], "key": request["key"], "start": started,
              "stream": bool(request.get("body", {}).get("stream")), "status": None, "error": None, "ttft": None}
    try:
        if "raw" in request:
            response = await http.post("/v1/chat/completions", content=request["raw"],
                                       headers={**headers, "Content-Type": "application/json"})
            result.update(status=response.status_code, code=response.json().get("error", {}).get("code"))
        elif not result["stream"]:
            response = await http.post("/v1/chat/completions", json=request["body"], headers=headers)
            data = response.json()
            result.update(status=response.status_code, code=data.get("error", {}).get("code"),
                          answered_by=data.get("model"))
            if response.status_code != 200:
                result["error"] = data.get("error", {}).get("message")
        else:
            async with http.stream("POST", "/v1/chat/completions", json=request["body"], headers=headers) as response:
                result["status"] = response.status_code
                if response.status_code != 200:
                    data = json.loads(await response.aread())
                    result.update(code=data.get("error", {}).get("code"), error=data.get("error", {}).get("message"))
                else:
                    async for line in response.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        event = json.loads(line[len("data: "):])
                        if "error" in event:
                            result["error"] = event["error"]["message"]
                            continue
                        result["answered_by"] = event.get("model")
                        if result["ttft"] is None and event["choices"] and event["choices"][0]["delta"].get(
                                "content"):
                            result["ttft"] = time.monotonic() - started
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["end"] = time.monotonic()
    return result


def outcome(r: dict) -> str:
    if r["status"] == 200 and r["error"] is None:
        return "served"
    if r["status"] == 401:
        return "refused: 401 bad key"
    if r["status"] in (400, 422):
        return f"refused: {r['status']} malformed"
    if r["status"] == 429:
        return f"refused: 429 {r.get('code')}"
    if r["status"] is not None and r["status"] < 500 and r["status"] != 200:
        return f"refused: {r['status']}"
    return "failed"


async def drive(url: str, args, kill: dict) -> list[dict]:
    rng = random.Random(args.seed)
    deadline = time.monotonic() + args.duration
    results: list[dict] = []

    async def client(n: int) -> None:
        local = random.Random(rng.random())
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            while time.monotonic() < deadline:
                results.append(await send(http, one_request(local)))

    async def killer() -> None:  # the replica of a the router favours (most requests running, then routed)
        await asyncio.sleep(args.kill_at)
        figures = await asyncio.to_thread(replica_figures, url, "a")
        replica = max(sorted(figures), key=lambda r: (figures[r].get("running", 0), figures[r].get("routed", 0)))
        pid = int(figures[replica]["pid"])
        kill.update(time=time.monotonic(), replica=replica, pid=pid, replicas_before=len(figures),
                    running=figures[replica].get("running", 0))
        os.kill(pid, signal.SIGKILL)
        print(f"killed replica {replica} of model a (pid {pid}, {kill['running']:g} requests running) at "
              f"{args.kill_at:g} s", file=sys.stderr, flush=True)

    await asyncio.gather(killer(), *(client(n) for n in range(args.concurrency)))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", type=Path, required=True, help="engine of model a (2 replicas)")
    parser.add_argument("--b", type=Path, required=True, help="engine of model b (1 replica)")
    parser.add_argument("--duration", type=float, default=120.0)
    parser.add_argument("--kill-at", type=float, default=40.0)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--bob-rpm", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="threads per engine replica")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("/tmp/kiln-fleet-load"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    fleet, keys = args.out / "fleet.toml", args.out / "keys.txt"
    fleet.write_text(f'[[models]]\nname = "a"\nengine = "{args.a.resolve()}"\nreplicas = 2\n\n'
                     f'[[models]]\nname = "b"\nengine = "{args.b.resolve()}"\n\n'
                     '[tiers.auto]\nmodels = ["a", "b"]\nprobe_tokens = 8\nmin_mean_logprob = -0.6\n')
    keys.write_text(f"{KEYS['alice']} name=alice\n{KEYS['bob']} name=bob rpm={args.bob_rpm}\n"
                    f"{KEYS['carol']} name=carol\n")
    proc, url = start_server(fleet, args.out / "server.log", args.threads, "--api-key-file", str(keys))
    try:
        load_before = os.getloadavg()[0]
        kill: dict = {}
        started = time.monotonic()
        results = asyncio.run(drive(url, args, kill))
        wall = time.monotonic() - started
        replicas_after = len(replica_figures(url, "a"))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    with open(args.out / "requests.jsonl", "w") as f:
        for r in results:
            f.write(json.dumps(r) + "\n")
    outcomes = Counter(outcome(r) for r in results)
    failed = [r for r in results if outcome(r) == "failed"]
    in_flight = [r for r in failed if r["model"] in ("a", "auto") and r["start"] <= kill["time"] <= r["end"]]
    print(f"{len(results)} requests in {wall:.0f} s from {args.concurrency} clients; load average "
          f"{load_before:.2f} before, {os.getloadavg()[0]:.2f} after; replica {kill['replica']} of a killed at "
          f"{kill['time'] - started:.0f} s ({kill['replicas_before']} replicas before, {replicas_after} at the end)")
    print("| outcome | requests |\n|---|---|")
    for name, count in sorted(outcomes.items()):
        print(f"| {name} | {count} |")
    print(f"failed: {len(failed)}, of them in flight on model a or the tier when a's replica died: "
          f"{len(in_flight)}")
    for r in failed:
        print(f"  failed: model {r['model']}, stream {r['stream']}, {r['status']}: {r['error']}")
    print("| model | served | streamed | latency p50 | latency p99 | first token p50 (streamed) |")
    print("|---|---|---|---|---|---|")
    for model in ("a", "b", "auto"):
        served = [r for r in results if r["model"] == model and outcome(r) == "served" and r["kind"] == "good"]
        latency = sorted(r["end"] - r["start"] for r in served)
        ttft = [r["ttft"] for r in served if r["ttft"] is not None]
        p99 = latency[min(len(latency) - 1, int(0.99 * len(latency)))]
        answered = Counter(r.get("answered_by") for r in served)
        print(f"| {model} | {len(served)} | {sum(r['stream'] for r in served)} | {statistics.median(latency):.2f} s | "
              f"{p99:.2f} s | {statistics.median(ttft):.2f} s |"
              + (f" answered by a {answered['a']}, b {answered['b']}" if model == "auto" else ""))
    wrong = [r for r in results if (r["kind"] == "good") != (outcome(r) in ("served", "failed", "refused: 429 "
                                                                             "rate_limit_exceeded", "refused: 429 queue_full"))]
    print(f"requests whose outcome does not match what they were (a bad key or body served, a good one refused "
          f"for other than a limit): {len(wrong)}")


if __name__ == "__main__":
    main()
