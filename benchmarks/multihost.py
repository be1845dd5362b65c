"""Rank groups across hosts made on this machine (hosts.py): decode step times of SmolLM2's tp=2 and pp=2 engines on
one host and split over two, at each link rate, beside what the planner's link model predicts for that link.

    python benchmarks/multihost.py [--rates 10gbit,1gbit] [--concurrency 1,8] [--output-len 64] [--out FILE.json]
        [--tp2 DIR] [--pp2 DIR]     (default: built here with the default plan, about a minute each)

Each figure is `engine-run bench`'s ITL p50 (a decode step: its sequences take one token each) for 16-token prompts,
run first with both ranks in one namespace (one host: they talk over loopback), then with `--nnodes 2` over hosts 0
and 1 with every host's sending rate limited (tc tbf). The planner's prediction is its communication term for the
step over that link less the same over one host's loopback (builder/planning/planner.py's all-reduce, all-gather
and transfer with the cpu device's link and node-link latency), printed beside the measured extra time over one host. The two hosts
share this machine's two cores, as the ranks of one host do."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from hosts import Hosts, available

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


def predicted_extra_ms(shape: str, rate: str, batch: int) -> float:
    """What the planner's link model adds to a decode step of `batch` sequences when the ranks' link is `rate` between
    two hosts instead of one host's loopback (the cpu device of plans/devices.toml: its link, and its node link's
    latency, fitted at 1 Gbit/s, at this rate): its all-reduces (tp) or hand-over (pp) and the logits' gather (tp),
    float32 activations. Only the exchanges: the namespace hosts share one machine's cores."""
    cpu = load_devices()["cpu"]
    scale = {"gbit": 1e9, "mbit": 1e6}[rate[-4:]]
    loopback = Link(cpu.link_gbs, cpu.link_latency_us)
    between = Link(float(rate[:-4]) * scale / 8 / 1e9, cpu.node_link_latency_us)

    def comm(link: Link) -> float:
        if shape == "tp2":
            return (2 * LAYERS + 1) * allreduce(link, 2, batch * HIDDEN * 4) + allgather(link, 2, batch * VOCAB * 4)
        return transfer(link, batch * HIDDEN * 4)

    return 1e3 * (comm(between) - comm(loopback))


def build(tp: int, pp: int, out: Path) -> Path:
    if not (out / "manifest.json").exists():
        subprocess.run(["engine-build", "build", "--tp", str(tp), "--pp", str(pp), "--out", str(out), "--force"],
                       check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=lambda s: s.split(","), default=["10gbit", "1gbit"])
    parser.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=[1, 8])
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--tp2", type=Path)
    parser.add_argument("--pp2", type=Path)
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args()
    why = available()
    if why:
        raise SystemExit(f"multihost: {why}")
    root = Path(tempfile.gettempdir())
    engines = {"tp2": args.tp2 or build(2, 1, root / "kiln-bench-smollm2-tp2"),
               "pp2": args.pp2 or build(1, 2, root / "kiln-bench-smollm2-pp2")}
    rows, load = [], [os.getloadavg()[0]]
    with Hosts(2) as hosts:
        for shape, engine in engines.items():
            alone = bench(hosts, engine, args.concurrency, args.output_len, 1, 29700)
            for rate in args.rates:
                hosts.set_rate(rate)
                split = bench(hosts, engine, args.concurrency, args.output_len, 2, 29701)
                hosts.set_rate(None)
                for c in args.concurrency:
                    rows.append({"shape": shape, "rate": rate, "concurrency": c, "one_host_ms": alone[c],
                                 "two_hosts_ms": split[c], "extra_ms": split[c] - alone[c],
                                 "planner_extra_ms": predicted_extra_ms(shape, rate, c)})
                    r = rows[-1]
                    print(f"{shape} {rate:>6} c={c}: one host {r['one_host_ms']:.1f} ms, two hosts "
                          f"{r['two_hosts_ms']:.1f} ms ({r['extra_ms']:+.1f}); the planner adds "
                          f"{r['planner_extra_ms']:+.1f} ms", flush=True)
            load.append(os.getloadavg()[0])
    print("load average (1 min) before and after each shape: " + ", ".join(f"{x:.1f}" for x in load))
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "load": load}, indent=2) + "\n")


if __name__ == "__main__":
    main()
