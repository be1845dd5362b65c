"""Tiered routing measured through a real server: share escalated, latency, and agreement with the strong model.

    python benchmarks/tier_check.py --cheap ENGINE --strong ENGINE [--thresholds -0.2,-0.4,-0.6,-0.8]
        [--rules mean,min] [--probe-tokens 8] [--max-tokens 32] [--out /tmp/kiln-tiers] [--plot docs/tiers.png]

One `engine-run serve --fleet` process serves the two engines ("cheap", "strong") and one tier per confidence
rule and threshold ("mean-0.4": cheap first, escalated when the mean log-probability of its first
--probe-tokens tokens is below -0.4; "min-2": when the least likely of them is below -2). Each shipped chat
prompt is sent, one request at a time, to the strong model, the cheap model and every tier (greedy,
--max-tokens tokens). For each it reports the share answered by the strong model (escalated), the latency (mean
and p50 of a whole non-streamed request), agreement (the share of answers identical to the strong model's), and
what escalating the same share of prompts at random would agree on (escalated + kept x the cheap model's
agreement), the yardstick the confidence rule has to beat. --plot draws agreement against the share escalated.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from builder.measure.calibration import shipped_text

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(fleet: Path, log: Path, threads: int, *extra: str) -> tuple[subprocess.Popen, str]:
    """`engine-run serve --fleet` on a free loopback port, once /health answers 200: (process, url)."""
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "runtime.cli", "serve", "--fleet", str(fleet), "--port",
                                 str(port), "--threads", str(threads), *extra], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the server did not start; see {log}")
        time.sleep(0.5)


def ask(url: str, model: str, message: str, max_tokens: int) -> dict:
    started = time.perf_counter()
    response = httpx.post(f"{url}/v1/chat/completions", timeout=600, json={
        "model": model, "messages": [{"role": "user", "content": message}], "max_tokens": max_tokens,
        "temperature": 0})
    response.raise_for_status()
    data = response.json()
    return {"text": data["choices"][0]["message"]["content"], "model": data["model"],
            "seconds": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cheap", type=Path, required=True)
    parser.add_argument("--strong", type=Path, required=True)
    parser.add_argument("--thresholds", default="-0.2,-0.4,-0.6,-0.8,-1.0",
                        help="min_mean_logprob of the mean rule's tiers")
    parser.add_argument("--min-thresholds", default="-1,-2,-3,-4,-5", help="min_mean_logprob of the min rule's tiers")
    parser.add_argument("--rules", default="mean,min")
    parser.add_argument("--probe-tokens", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="threads per engine (requests run one at a time)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/kiln-tiers"))
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    thresholds = {"mean": args.thresholds, "min": args.min_thresholds}
    tiers = {f"{rule}{float(t):g}": (rule, float(t)) for rule in args.rules.split(",")
             for t in thresholds[rule].split(",")}
    fleet = args.out / "fleet.toml"
    fleet.write_text(f'[[models]]\nname = "cheap"\nengine = "{args.cheap.resolve()}"\n\n'
                     f'[[models]]\nname = "strong"\nengine = "{args.strong.resolve()}"\n'
                     + "".join(f'\n[tiers."{name}"]\nmodels = ["cheap", "strong"]\nprobe_tokens = {args.probe_tokens}'
                               f'\nmin_mean_logprob = {t}\nconfidence = "{rule}"\n' for name, (rule, t) in tiers.items()))
    messages = [line for line in shipped_text("chat_prompts").splitlines() if line.strip()]
    proc, url = start_server(fleet, args.out / "server.log", args.threads)
    runs: dict[str, list[dict]] = {name: [] for name in ["strong", "cheap", *tiers]}
    try:
        for i, message in enumerate(messages):
            for name in runs:  # interleaved: each prompt on every model and tier before the next prompt
                runs[name].append(ask(url, name, message, args.max_tokens))
            print(f"\r{i + 1}/{len(messages)} prompts", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    strong = [r["text"] for r in runs["strong"]]
    cheap_agreement = sum(r["text"] == s for r, s in zip(runs["cheap"], strong)) / len(strong)
    rows = []
    for name, results in runs.items():
        seconds = [r["seconds"] for r in results]
        escalated = sum(r["model"] == "strong" for r in results) / len(results)
        rule, threshold = tiers.get(name, (None, None))
        rows.append({"route": name, "rule": rule, "threshold": threshold, "escalated": escalated,
                     "agreement": sum(r["text"] == s for r, s in zip(results, strong)) / len(results),
                     "at_random": escalated + (1 - escalated) * cheap_agreement,
                     "mean_s": statistics.fmean(seconds), "p50_s": statistics.median(seconds)})
    (args.out / "tiers.json").write_text(json.dumps({"prompts": len(messages), "max_tokens": args.max_tokens,
                                                     "probe_tokens": args.probe_tokens, "rows": rows,
                                                     "runs": runs}, indent=1))
    print(f"{len(messages)} shipped chat prompts, greedy, {args.max_tokens} tokens, one request at a time; "
          f"load average {os.getloadavg()[0]:.2f}")
    print("| route | answered by strong | agreement with strong | escalating as many at random | mean latency | "
          "p50 latency |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        label = row["route"] if row["rule"] is None else f"tier: {row['rule']} log-prob < {row['threshold']:g}"
        print(f"| {label} | {row['escalated']:.0%} | {row['agreement']:.0%} | {row['at_random']:.0%} | "
              f"{row['mean_s'] * 1000:.0f} ms | {row['p50_s'] * 1000:.0f} ms |")
    if args.plot is not None:
        plot(rows, args.plot)
        print(f"plot: {args.plot}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_route = {r["route"]: r for r in rows}
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for rule, marker in (("mean", "o-"), ("min", "s-")):
        points = sorted((r for r in rows if r["rule"] == rule), key=lambda r: r["escalated"])
        if points:
            left.plot([100 * r["escalated"] for r in points], [100 * r["agreement"] for r in points], marker,
                      label=f"tier, {rule} log-prob rule")
            right.plot([100 * r["escalated"] for r in points], [r["mean_s"] * 1000 for r in points], marker,
                       label=f"tier, {rule} rule")
    cheap = by_route["cheap"]["agreement"]
    left.plot([0, 100], [100 * cheap, 100], "--", color="grey", label="escalating at random")
    left.set_xlabel("% of requests answered by the strong model")
    left.set_ylabel("% of answers identical to the strong model's")
    left.set_xlim(0, 100)
    left.set_ylim(0, 102)
    left.legend(fontsize=8, loc="lower right")
    for route, style in (("cheap", ":"), ("strong", "-.")):
        right.axhline(by_route[route]["mean_s"] * 1000, ls=style, color="grey", label=f"{route} alone")
    right.set_xlabel("% of requests answered by the strong model")
    right.set_ylabel("mean request latency (ms)")
    right.set_xlim(0, 100)
    right.legend(fontsize=8)
    fig.suptitle("Tiered routing: the cheap model first, escalated on low confidence over its first tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
