"""Across hosts made on this machine (hosts.py), SmolLM2: rank groups, disaggregated serving and a host lost.

    python benchmarks/multihost.py [--parts ranks,disaggregated,host-loss] [--rates 10gbit,1gbit]
        [--concurrency 1,8] [--output-len 64] [--requests 10] [--out FILE.json]
        [--tp2 DIR] [--pp2 DIR] [--engine DIR]   (default: built here with the default plan, about a minute each)

ranks: decode step times of the tp=2 and pp=2 engines on one host and split over two, at each link rate, beside what
the planner's link model predicts for that link.

Each figure is `engine-run bench`'s ITL p50 (a decode step: its sequences take one token each) for 16-token prompts,
run first with both ranks in one namespace (one host: they talk over loopback), then with `--nnodes 2` over hosts 0
and 1 with every host's sending rate limited (tc tbf). The planner's prediction is its communication term for the
step over that link less the same over one host's loopback (builder/planning/planner.py's all-reduce, all-gather
and transfer with the cpu device's link and node-link latency), printed beside the measured extra time over one
host. The two hosts share this machine's two cores, as the ranks of one host do.

disaggregated: `engine-run serve --disaggregate 1:1` with both workers on host 0, then with the prefill worker on host 0
and the decode worker on host 1 (Ray resources kiln_prefill and kiln_decode) at each rate: --requests streamed chat
requests one at a time from host 0, each with a prompt of its own (~200 tokens, no prefix-cache hits) and 16
tokens out. Time to first token (the prefill worker's token), time from it to the second (the K/V hand-over lands
there: the decode worker's first step), and per hand-over its bytes and time (kiln_replica_kv_handoff_* from
/metrics), beside the planner's transfer time for those bytes over the link.

host-loss: benchmarks/host_loss.py's two-minute load with host 1 killed at 40 s (two replicas, --spread)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import host_loss
from hosts import RAY_ENV, Hosts, available, ray_cluster

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from builder.planning.plan import load_devices  # noqa: E402
from builder.planning.planner import Link, allgather, allreduce, transfer  # noqa: E402

HIDDEN, LAYERS, VOCAB = 576, 30, 49152  # SmolLM2-135M


def bench(hosts: Hosts, engine: Path, concurrency: list[int], output_len: int, nodes: int, port: int) -> dict:
    """ITL p50 (ms) per concurrency: one host (host 0 alone) or over hosts 0 and 1."""
    with tempfile.TemporaryDirectory() as tmp:
        args = [sys.executable, "-m", "runtime.cli", "bench", str(engine), "--prompt-len", "16", "--output-len",
                str(output_len), "--no-roofline", "--threads", "1", "--rank-timeout", "60"]
        for c in concurrency:
            args += ["-c", str(c)]
        procs = []
        for node in range(nodes):
            extra = ["--nnodes", "2", "--node-rank", str(node), "--master-addr", hosts.address(0), "--master-port",
                     str(port)] if nodes == 2 else []
            out = ["--json", f"{tmp}/bench.json"] if node == 0 else []
            procs.append(hosts.popen(node, [*args, *extra, *out], cwd=REPO, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True))
        for proc in procs:
            _, err = proc.communicate(timeout=1800)
            if proc.returncode:
                raise SystemExit(f"multihost: engine-run bench failed: {err.strip()[-600:]}")
        levels = json.loads(Path(f"{tmp}/bench.json").read_text())["levels"]
    return {level["concurrency"]: level["itl_p50_ms"] for level in levels}


def link(rate: str | None) -> Link:
    """The planner's link for a rate ("10gbit", "500mbit") between two hosts (the cpu device's node-link latency),
    or for None one host's loopback (the cpu device's own link), as plans/devices.toml gives them."""
    cpu = load_devices()["cpu"]
    if rate is None:
        return Link(cpu.link_gbs, cpu.link_latency_us)
    return Link(float(rate[:-4]) * {"gbit": 1e9, "mbit": 1e6}[rate[-4:]] / 8 / 1e9, cpu.node_link_latency_us)


def predicted_extra_ms(shape: str, rate: str, batch: int) -> float:
    """What the planner's link model adds to a decode step of `batch` sequences when the ranks' link is `rate` between
    two hosts instead of one host's loopback (the cpu device of plans/devices.toml: its link, and its node link's
    latency, fitted at 1 Gbit/s, at this rate): its all-reduces (tp) or hand-over (pp) and the logits' gather (tp),
    float32 activations. Only the exchanges: the namespace hosts share one machine's cores."""
    loopback, between = link(None), link(rate)

    def comm(link: Link) -> float:
        if shape == "tp2":
            return (2 * LAYERS + 1) * allreduce(link, 2, batch * HIDDEN * 4) + allgather(link, 2, batch * VOCAB * 4)
        return transfer(link, batch * HIDDEN * 4)

    return 1e3 * (comm(between) - comm(loopback))


# ---------------------------------------------------------------------------------------- disaggregated serving

TEXT = ("A kiln is a thermally insulated chamber, a type of oven, that produces temperatures sufficient to complete "
        "some process, such as hardening, drying, or chemical changes. Kilns have been used for millennia to turn "
        "objects made from clay into pottery, bricks and tiles. Modern kilns burn gas or run on electricity, and "
        "their firing schedules are controlled by computers that raise and hold the temperature in steps. ")


def client(url: str, requests: int) -> None:
    """On host 0: one untimed request, then `requests` streamed ones in turn; prints their TTFT and second-token
    times and the decode replica's hand-over counters read from /metrics before and after, as JSON."""
    import httpx

    def handoffs() -> list[float]:
        rows = [line.split() for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
                if line.startswith("kiln_replica_kv_handoff")]
        return [sum(float(v) for name, v in rows if name.startswith(f"kiln_replica_{key}{{"))
                for key in ("kv_handoffs", "kv_handoff_bytes", "kv_handoff_seconds")]

    def one(i: int) -> tuple[float, float]:
        body = {"model": "smollm2", "temperature": 0, "max_tokens": 16, "stream": True, "messages": [
            {"role": "user", "content": f"Note {os.getpid()}-{i}. {TEXT * 2}Summarise this in one sentence."}]}
        start, marks = time.perf_counter(), []
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and any(c["delta"].get("content")
                                                      for c in json.loads(line[6:])["choices"]):
                    marks.append(time.perf_counter() - start)
        return marks[0], marks[1] - marks[0]

    deadline = time.monotonic() + 600
    while True:
        try:
            one(-1)
            break
        except (httpx.HTTPError, IndexError):
            if time.monotonic() > deadline:
                raise SystemExit("multihost: the endpoint never answered") from None
            time.sleep(2)
    time.sleep(2.5)  # the replicas' figures reach the ingress about once a second
    before = handoffs()
    times = [one(i) for i in range(requests)]
    time.sleep(2.5)
    after = handoffs()
    print(json.dumps({"ttft_s": [t for t, _ in times], "second_token_s": [t for _, t in times],
                      "handoffs": [b - a for a, b in zip(before, after)]}), flush=True)


def serve_disaggregated(hosts: Hosts, url: str, members: list[int], work: Path, requests: int,
                        rates: list[str | None]) -> dict:
    """`engine-run serve URL --disaggregate 1:1` on a Ray cluster of `members` (two: prefill on the first, decode on
    the second), the client's figures at each rate."""
    resources = [{"kiln_prefill": 1}, {"kiln_decode": 1}] if len(members) == 2 else []
    caches = [work / f"cache{host}" for host in members]
    figures = {}
    with ray_cluster(hosts, members, caches, resources) as address:
        serve = hosts.popen(0, [sys.executable, "-m", "runtime.cli", "serve", url, "--model-name", "smollm2",
                                "--disaggregate", "1:1", "--ray-address", address, "--host", hosts.address(0),
                                "--port", "8000", "--threads", "1"], cwd=REPO,
                            env=dict(os.environ, **RAY_ENV, KILN_CACHE_DIR=str(caches[0])),
                            stdout=open(work / "serve.log", "a"), stderr=subprocess.STDOUT)
        try:
            for rate in rates:
                hosts.set_rate(rate)
                base = f"http://{hosts.address(0)}:8000"
                done = subprocess.run(hosts.command(0, [sys.executable, __file__, "--client", base, "--requests",
                                                        str(requests)]),
                                      cwd=REPO, capture_output=True, text=True, timeout=1200)
                if done.returncode:
                    raise SystemExit(f"multihost: the client failed: {done.stderr.strip()[-600:]}; see "
                                     f"{work / 'serve.log'}")
                figures[rate] = json.loads(done.stdout.splitlines()[-1])
        finally:
            hosts.set_rate(None)
            serve.terminate()
            serve.wait(timeout=120)
    return figures


def disaggregated(hosts: Hosts, engine: Path, rates: list[str], requests: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        files = hosts.popen(0, [sys.executable, "-m", "http.server", "8483", "--bind", hosts.address(0),
                                "--directory", str(engine.parent)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
        url = f"http://{hosts.address(0)}:8483/{engine.name}"
        try:
            runs = {"one host": serve_disaggregated(hosts, url, [0], Path(tmp), requests, [None])[None]}
            split = serve_disaggregated(hosts, url, [0, 1], Path(tmp), requests, rates)
            runs.update({f"two hosts, {rate}": split[rate] for rate in rates})
        finally:
            files.kill()
    for (name, run), rate in zip(runs.items(), [None, *rates]):
        count, num_bytes, seconds = run["handoffs"]
        per = num_bytes / count if count else 0.0
        rows.append({"where": name, "rate": rate, "ttft_p50_ms": 1e3 * statistics.median(run["ttft_s"]),
                     "second_token_p50_ms": 1e3 * statistics.median(run["second_token_s"]),
                     "handoffs": count, "handoff_bytes": per, "handoff_ms": 1e3 * seconds / count if count else None,
                     "planner_transfer_ms": 1e3 * transfer(link(rate), per)})
        r = rows[-1]
        print(f"disaggregated, {name}: TTFT p50 {r['ttft_p50_ms']:.1f} ms, to the second token "
              f"{r['second_token_p50_ms']:.1f} ms; {count:.0f} hand-overs of {per / 1e6:.2f} MB, "
              f"{r['handoff_ms'] or 0:.1f} ms each (the planner's transfer: {r['planner_transfer_ms']:.1f} ms)",
              flush=True)
    return rows


def build(tp: int, pp: int, out: Path) -> Path:
    if not (out / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "builder.cli", "build", "--tp", str(tp), "--pp", str(pp), "--out",
                        str(out), "--force"],
                       check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return out


def ranks(hosts: Hosts, engines: dict[str, Path], rates: list[str], concurrency: list[int],
          output_len: int) -> list[dict]:
    rows = []
    for shape, engine in engines.items():
        alone = bench(hosts, engine, concurrency, output_len, 1, 29700)
        for rate in rates:
            hosts.set_rate(rate)
            split = bench(hosts, engine, concurrency, output_len, 2, 29701)
            hosts.set_rate(None)
            for c in concurrency:
                rows.append({"shape": shape, "rate": rate, "concurrency": c, "one_host_ms": alone[c],
                             "two_hosts_ms": split[c], "extra_ms": split[c] - alone[c],
                             "planner_extra_ms": predicted_extra_ms(shape, rate, c)})
                r = rows[-1]
                print(f"{shape} {rate:>6} c={c}: one host {r['one_host_ms']:.1f} ms, two hosts "
                      f"{r['two_hosts_ms']:.1f} ms ({r['extra_ms']:+.1f}); the planner adds "
                      f"{r['planner_extra_ms']:+.1f} ms", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", type=lambda s: s.split(","), default=["ranks", "disaggregated", "host-loss"])
    parser.add_argument("--rates", type=lambda s: s.split(","), default=["10gbit", "1gbit"])
    parser.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=[1, 8])
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--requests", type=int, default=10, help="disaggregated: streamed requests at each setting")
    parser.add_argument("--tp2", type=Path)
    parser.add_argument("--pp2", type=Path)
    parser.add_argument("--engine", type=Path, help="the one-rank engine (disaggregated, host-loss)")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    parser.add_argument("--client", help=argparse.SUPPRESS)  # disaggregated: the load, run on host 0
    args = parser.parse_args()
    if args.client:
        client(args.client, args.requests)
        return
    unknown = set(args.parts) - {"ranks", "disaggregated", "host-loss"}
    if unknown:
        raise SystemExit(f"multihost: unknown part(s) {', '.join(sorted(unknown))}; known: ranks, disaggregated, "
                         "host-loss")
    why = available()
    if why:
        raise SystemExit(f"multihost: {why}")
    root = Path(tempfile.gettempdir())
    engine = args.engine or build(1, 1, root / "kiln-bench-smollm2")
    result, load = {}, [os.getloadavg()[0]]
    if "ranks" in args.parts:
        engines = {"tp2": args.tp2 or build(2, 1, root / "kiln-bench-smollm2-tp2"),
                   "pp2": args.pp2 or build(1, 2, root / "kiln-bench-smollm2-pp2")}
        with Hosts(2) as hosts:
            result["ranks"] = ranks(hosts, engines, args.rates, args.concurrency, args.output_len)
        load.append(os.getloadavg()[0])
    if "disaggregated" in args.parts:
        with Hosts(2) as hosts:
            result["disaggregated"] = disaggregated(hosts, engine.resolve(), args.rates, args.requests)
        load.append(os.getloadavg()[0])
    if "host-loss" in args.parts:
        loss = argparse.Namespace(engine=engine, seconds=120.0, kill_at=40.0, concurrency=4, timeout=60.0)
        with tempfile.TemporaryDirectory() as work, Hosts(2, rate="1gbit") as hosts:
            outcome = host_loss.run(loss, hosts, Path(work))
        host_loss.report(outcome)
        result["host_loss"] = {k: v for k, v in outcome.items() if k != "records"}
        load.append(os.getloadavg()[0])
    print("load average (1 min) at the start and after each part: " + ", ".join(f"{x:.1f}" for x in load))
    if args.out:
        args.out.write_text(json.dumps({**result, "load": load}, indent=2) + "\n")


if __name__ == "__main__":
    main()
