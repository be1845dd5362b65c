"""Hosts made on this machine for multi-host tests and benchmarks: network namespaces, each with an address of its
own on one bridge, links limited to a chosen rate, and everything removed at the end, even on failure.

    with Hosts(3, rate="1gbit") as hosts:
        hosts.address(0)                        # "10.231.7.1"
        proc = hosts.popen(1, ["python", ...])  # runs inside host 1's namespace
        hosts.set_rate("10gbit")
        with ray_cluster(hosts, [0, 1], caches) as address:  # Ray's head on host 0, a worker on host 1
            ...

Each host is a namespace `kiln-<tag>-<i>` with loopback and one veth (eth0, 10.231.<net>.<i+1>/24) whose other end is
on a bridge in the root namespace that has no address: the hosts reach each other and nothing else (no route leaves
the subnet), and nothing outside reaches them. The rate is a token-bucket filter (tc tbf) on each host's eth0, so
every packet a host sends waits for its share of the link; this kernel has no netem, so latency is only the rate's
and the stack's. The hosts share this machine's CPUs, memory and file system: what a file-system path holds on one
holds on all (a test of engines reaching a host gives each host its own cache folder). Needs root (CAP_NET_ADMIN);
`available()` says why not, for a skip."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}  # a cluster of these hosts only


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"kiln-probe-{os.getpid()}"
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


def _burst(rate: str) -> str:
    """tbf's bucket: at least one 4 ms tick of the rate (tbf needs rate / HZ), and 64 KiB."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return f"{max(64 * 1024, int(float(rate[:-len(unit)]) * scale / 8 / 250))}"
    raise ValueError(f"rate {rate!r}: give a number with kbit, mbit or gbit")


class Hosts:
    def __init__(self, count: int, rate: str | None = None):
        self.count, self.rate = count, rate
        self.tag = secrets.token_hex(2)
        self.net = 100 + int(self.tag, 16) % 150  # the subnet's third byte
        self.bridge = f"kb{self.tag}"
        self.names = [f"kiln-{self.tag}-{i}" for i in range(count)]
        self.procs: list[tuple[int, subprocess.Popen]] = []

    def address(self, host: int) -> str:
        return f"10.231.{self.net}.{host + 1}"

    def __enter__(self) -> Hosts:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for i, name in enumerate(self.names):
                outer, inner = f"kv{self.tag}{i}", f"ki{self.tag}{i}"
                _ip("netns", "add", name)
                _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
                _ip("link", "set", outer, "master", self.bridge)
                _ip("link", "set", outer, "up")
                _ip("link", "set", inner, "netns", name)
                _ip("-n", name, "link", "set", inner, "name", "eth0")
                _ip("-n", name, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
                _ip("-n", name, "link", "set", "eth0", "up")
                _ip("-n", name, "link", "set", "lo", "up")
            if self.rate:
                self.set_rate(self.rate)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def set_rate(self, rate: str | None) -> None:
        """Every host's sending rate (tbf on its eth0); None: unlimited."""
        for name in self.names:
            subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "del", "dev", "eth0", "root"],
                           capture_output=True, timeout=30)
            if rate:
                subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf",
                                "rate", rate, "burst", _burst(rate), "latency", "50ms"],
                               check=True, capture_output=True, timeout=30)
        self.rate = rate

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.names[host], *argv]

    def popen(self, host: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """argv run in host's namespace; stopped (SIGKILL) by close() or kill() if still running."""
        proc = subprocess.Popen(self.command(host, argv), **kwargs)
        self.procs.append((host, proc))
        return proc

    def kill(self, host: int) -> None:
        """Every process on `host`, at once (a host lost): those started here and whatever they started that lives
        in its namespace (`ip netns pids`: Ray's daemons, rank processes)."""
        for where, proc in self.procs:
            if where == host and proc.poll() is None:
                proc.kill()
        listed = _ip("netns", "pids", self.names[host], check=False).stdout.split()
        for pid in listed:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        for where, proc in self.procs:
            if where == host:
                proc.wait()

    def close(self) -> None:
        for host in range(self.count):
            self.kill(host)
        for name in self.names:
            _ip("netns", "del", name, check=False)  # its veth end goes with it, and the pair with that
        _ip("link", "del", self.bridge, check=False)


@contextlib.contextmanager
def ray_cluster(hosts: Hosts, members: Sequence[int], caches: Sequence[Path], resources: Sequence[dict] = (),
                port: int = 6399) -> Iterator[str]:
    """A Ray cluster of hosts `members`, the first one the head: yields the head's address. Each member runs one
    CPU's worth of Ray with its own Kiln cache folder (caches[i], KILN_CACHE_DIR, which the replicas it runs inherit)
    and the custom resources resources[i] (e.g. {"kiln_decode": 1}); everything stopped at the end, even on
    failure."""
    address = f"{hosts.address(members[0])}:{port}"
    try:
        for i, host in enumerate(members):
            ray_join(hosts, host, None if i == 0 else address, caches[i], resources[i] if i < len(resources) else {},
                     port)
        yield address
    finally:  # the hosts share one process table: `ray stop` on one ends every member's daemons
        subprocess.run(hosts.command(members[0], ["ray", "stop", "--force"]), capture_output=True, timeout=120)


def ray_join(hosts: Hosts, host: int, address: str | None, cache: Path, resources: dict, port: int = 6399) -> None:
    """Ray started on `host`: the head (address None, on `port`) or a worker joining the head at `address`, with one
    CPU, its own Kiln cache folder and the custom `resources`; RuntimeError if `ray start` fails."""
    start = ["--head", "--port", str(port), "--include-dashboard", "false"] if address is None else ["--address",
                                                                                                    address]
    extra = ["--resources", json.dumps(resources)] if resources else []
    ray = subprocess.run(hosts.command(host, ["ray", "start", *start, "--node-ip-address", hosts.address(host),
                                              "--num-cpus", "1", "--disable-usage-stats", *extra]),
                         env=dict(os.environ, **RAY_ENV, KILN_CACHE_DIR=str(cache)), capture_output=True, text=True,
                         timeout=180)
    if ray.returncode:
        raise RuntimeError(f"ray start on host {host} failed: {ray.stderr.strip()[-600:]}")
