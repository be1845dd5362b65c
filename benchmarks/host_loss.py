"""A host lost under load: two replicas of SmolLM2 on a Ray cluster of two hosts made on this machine (hosts.py), one
replica a host (`engine-run serve URL --replicas 2 --spread`, each fetching the engine by URL), a mixed load from
host 0 for --seconds, and every process of host 1 killed at --kill-at seconds: requests served and failed by
reason, latency p50/p99 before and after the loss, and how long the endpoint took to serve from host 0 alone.

    python benchmarks/host_loss.py [--engine engines/smollm2-135m] [--seconds 120] [--kill-at 40] [--concurrency 4]
        [--timeout 60] [--out FILE.json]

The load: --concurrency clients in a closed loop, each sending chat requests with one of a few prompts and
max_tokens of 16, 32 or 64 (greedy; every third one streamed), each with a --timeout. Needs root (network
namespaces) and Ray (the `serve` extra). The hosts share this machine's two cores: host 0 runs the ingress, its
replica and the load; host 1 its replica.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hosts import RAY_ENV, Hosts, available, ray_cluster

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["What is the capital of France?", "List three colors.", "Write a haiku about the sea.",
           "Explain what a CPU cache is in two sentences.", "Give me a short packing list for a weekend trip."]


# ---------------------------------------------------------------------------------------- the load (on host 0)

async def client_loop(url: str, seconds: float, concurrency: int, timeout: float) -> list[dict]:
    import httpx

    rng, records, start = random.Random(0), [], time.monotonic()

    async def one(http: httpx.AsyncClient, i: int) -> dict:
        body = {"model": "smollm2", "temperature": 0, "max_tokens": rng.choice([16, 32, 64]),
                "messages": [{"role": "user", "content": rng.choice(PROMPTS)}], "stream": i % 3 == 0}
        began = time.monotonic() - start
        outcome, said = "ok", ""
        try:
            if body["stream"]:
                async with http.stream("POST", "/v1/chat/completions", json=body, timeout=timeout) as r:
                    text = "".join([line async for line in r.aiter_lines()])
                    if r.status_code != 200:
                        outcome, said = f"HTTP {r.status_code}", text
                    elif "[DONE]" not in text or '"error"' in text:
                        outcome, said = "stream ended with an error", text[-300:]
            else:
                r = await http.post("/v1/chat/completions", json=body, timeout=timeout)
                if r.status_code != 200:
                    outcome, said = f"HTTP {r.status_code}", r.text
        except httpx.TimeoutException:
            outcome = f"no answer in {timeout:g} s"
        except httpx.HTTPError as exc:
            outcome = type(exc).__name__
        return {"start": began, "end": time.monotonic() - start, "outcome": outcome, "said": said[:300],
                "streamed": body["stream"]}

    async def worker(http: httpx.AsyncClient, w: int) -> None:
        i = w
        while time.monotonic() - start < seconds:
            records.append(await one(http, i))
            i += concurrency

    async with httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=concurrency + 2)) as http:
        await asyncio.gather(*(worker(http, w) for w in range(concurrency)))
    return records


def client(url: str, seconds: float, concurrency: int, timeout: float) -> None:
    """Waits for the endpoint, sends one request untimed, prints "started", runs the load, prints its records."""
    import httpx

    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
                    "model": "smollm2", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}).is_success:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit("host_loss: the endpoint never answered")
        time.sleep(2)
    print("started", flush=True)
    print(json.dumps(asyncio.run(client_loop(url, seconds, concurrency, timeout))), flush=True)


# ---------------------------------------------------------------------------------------- the cluster

def summary(records: list[dict], killed_at: float) -> dict:
    def phase(rows: list[dict]) -> dict:
        ok = sorted(r["end"] - r["start"] for r in rows if r["outcome"] == "ok")
        failed: dict[str, int] = {}
        for r in rows:
            if r["outcome"] != "ok":
                failed[r["outcome"]] = failed.get(r["outcome"], 0) + 1
        return {"requests": len(rows), "served": len(ok), "failed": failed,
                "p50_s": statistics.median(ok) if ok else None,
                "p99_s": ok[min(len(ok) - 1, int(0.99 * len(ok)))] if ok else None}

    before = [r for r in records if r["end"] <= killed_at]
    during = [r for r in records if r["start"] < killed_at < r["end"]]
    after = [r for r in records if r["start"] >= killed_at]
    first_ok = min((r["end"] for r in after if r["outcome"] == "ok"), default=None)
    steady = [r for r in after if first_ok is not None and r["start"] >= first_ok]
    return {"before": phase(before), "in_flight_at_the_loss": phase(during), "after": phase(after),
            "after_the_first_answer_from_host_0_alone": phase(steady),
            "first_answer_after_the_loss_s": None if first_ok is None else first_ok - killed_at}


def run(args, hosts: Hosts, work: Path) -> dict:
    engine = args.engine.resolve()
    files = hosts.popen(0, [sys.executable, "-m", "http.server", "8482", "--bind", hosts.address(0), "--directory",
                            str(engine.parent)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://{hosts.address(0)}:8482/{engine.name}"
    try:
        with ray_cluster(hosts, [0, 1], [work / "cache0", work / "cache1"]) as address:
            return load_and_loss(args, hosts, work, url, address)
    except RuntimeError as exc:  # a ray start that failed
        raise SystemExit(f"host_loss: {exc}") from None
    finally:
        files.kill()


def load_and_loss(args, hosts: Hosts, work: Path, url: str, address: str) -> dict:
    serve = hosts.popen(0, [sys.executable, "-m", "runtime.cli", "serve", url, "--model-name", "smollm2",
                            "--replicas", "2", "--spread", "--routing", "round-robin", "--ray-address", address,
                            "--host", hosts.address(0), "--port", "8000", "--threads", "1"], cwd=REPO,
                        env=dict(os.environ, **RAY_ENV, KILN_CACHE_DIR=str(work / "cache0")),
                        stdout=open(work / "serve.log", "w"), stderr=subprocess.STDOUT)
    load = hosts.popen(0, [sys.executable, __file__, "--client", f"http://{hosts.address(0)}:8000",
                           "--seconds", str(args.seconds), "--concurrency", str(args.concurrency),
                           "--timeout", str(args.timeout)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    if load.stdout.readline().strip() != "started":
        raise SystemExit(f"host_loss: the load never started; see {work / 'serve.log'}")
    started = time.monotonic()
    print(f"[{0:6.1f}s] load started: {args.concurrency} clients for {args.seconds:g} s", flush=True)
    time.sleep(args.kill_at)
    hosts.kill(1)
    killed_at = time.monotonic() - started
    print(f"[{killed_at:6.1f}s] host 1 killed (its raylet, its replica)", flush=True)
    records = json.loads(load.stdout.readline())
    load.wait(timeout=60)
    print(f"[{time.monotonic() - started:6.1f}s] load done; serve still running: {serve.poll() is None}")
    return {"records": records, "killed_at_s": killed_at, "serve_alive": serve.poll() is None,
            **summary(records, killed_at)}


def report(result: dict) -> None:
    """The summary, each failed request and the first answer after the loss, printed."""
    for name in ("before", "in_flight_at_the_loss", "after", "after_the_first_answer_from_host_0_alone"):
        p = result[name]
        latency = f"p50 {p['p50_s']:.2f} s, p99 {p['p99_s']:.2f} s" if p["served"] else "none served"
        print(f"{name.replace('_', ' ')}: {p['requests']} requests, {p['served']} served ({latency}), failed "
              f"{p['failed'] or 'none'}")
    for r in result["records"]:
        if r["outcome"] != "ok":
            print(f"failed at {r['end']:.1f} s ({'streamed' if r['streamed'] else 'whole'}, started {r['start']:.1f} s): "
                  f"{r['outcome']}: {r['said'][:200]}")
    first = result["first_answer_after_the_loss_s"]
    print("first answer after the loss: " + ("none" if first is None else f"{first:.2f} s after it"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", type=Path, default=REPO / "engines" / "smollm2-135m")
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--kill-at", type=float, default=40.0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=60.0, help="a request's client-side limit, seconds")
    parser.add_argument("--out", type=Path, help="write the summary and every request's record as JSON here")
    parser.add_argument("--client", help=argparse.SUPPRESS)  # the load itself, run on host 0
    args = parser.parse_args()
    if args.client:
        client(args.client, args.seconds, args.concurrency, args.timeout)
        return
    why = available()
    if why:
        raise SystemExit(f"host_loss: cannot make hosts here: {why}")
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as work, Hosts(2, rate="1gbit") as hosts:
        result = run(args, hosts, Path(work))
    load.append(os.getloadavg()[0])
    report(result)
    print(f"load average (1 min) before, after: {load[0]:.1f}, {load[1]:.1f}")
    if args.out:
        args.out.write_text(json.dumps({**result, "load": load}, indent=2) + "\n")


if __name__ == "__main__":
    main()
