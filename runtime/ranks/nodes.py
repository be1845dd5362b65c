"""Rank groups over several hosts without Ray or torchrun: the same `engine-run generate|serve|bench ENGINE
--nnodes N --node-rank R --master-addr ADDR --master-port PORT` run once on each host.

Host R runs ranks R * W/N .. (R + 1) * W/N - 1 of the engine's W (its first in the `engine-run` process, the others
as child processes, as a one-host launch does). Host 0's first rank is rank 0: it serves the rendezvous store on
ADDR:PORT and schedules; the other hosts' processes only serve rank 0's steps and exit when it does. Ranks join
over TCP (torch.distributed's store, then gloo, or NCCL for CUDA tensors), each host through the interface that
reaches ADDR (GLOO_SOCKET_IFNAME, unless already set: gloo otherwise binds to the address the host name resolves
to, which another host may not reach)."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
from dataclasses import dataclass

from runtime.format.engine_format import EngineError
from runtime.ranks.rendezvous import Rendezvous


@dataclass(frozen=True)
class Nodes:
    count: int        # hosts (--nnodes)
    rank: int         # this host (--node-rank)
    master_addr: str  # host 0's address the others reach (--master-addr)
    master_port: int  # its rendezvous port (--master-port)

    def __post_init__(self):
        if self.count < 1 or not 0 <= self.rank < self.count:
            raise EngineError(f"--node-rank {self.rank} must be in 0..{self.count - 1} (--nnodes {self.count})")
        if not 0 < self.master_port < 65536:
            raise EngineError(f"--master-port {self.master_port} is not a TCP port")

    def per_host(self, world_size: int) -> int:
        """Ranks each host runs: the engine's world size split evenly."""
        if world_size % self.count:
            raise EngineError(f"the engine has {world_size} ranks, which {self.count} hosts cannot share evenly "
                              f"(--nnodes must divide the world size)")
        return world_size // self.count

    def rendezvous(self, world_size: int, timeout: float) -> Rendezvous:
        """This host's first rank's rendezvous; host 0's serves the store."""
        return Rendezvous(self.rank * self.per_host(world_size), world_size, self.master_addr, self.master_port,
                          self.rank == 0, timeout)


def route_interface(addr: str) -> str | None:
    """The name of the network interface this host sends packets to `addr` through, or None (loopback, or not
    found). Read from the kernel's choice of source address (a UDP socket connects without sending) and the
    interfaces' addresses (`ip -o addr`)."""
    try:
        target = socket.gethostbyname(addr)
        if ipaddress.ip_address(target).is_loopback:
            return None
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((target, 9))
            source = probe.getsockname()[0]
        listing = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in listing.splitlines():  # "3: eth0    inet 10.0.0.2/24 brd ... scope global eth0"
        fields = line.split()
        if len(fields) > 3 and fields[3].split("/")[0] == source:
            return fields[1]
    return None


def use_route_to(addr: str) -> None:
    """Make gloo (this process and the rank processes it starts) use the interface that reaches `addr`."""
    interface = route_interface(addr)
    if interface and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = interface
