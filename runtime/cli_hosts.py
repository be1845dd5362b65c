"""engine-run's options for a rank group over several hosts (runtime/ranks/nodes.py, launcher.host_group):
torchrun's flags, the same command run once on each host."""

from __future__ import annotations

import typer

NNODES = typer.Option(1, "--nnodes", min=1,
                      help="Hosts the engine's ranks run on: run the same command once on each, with its "
                           "--node-rank; host 0 schedules (and serves or prints), the others only compute. "
                           "serve --ray-address: Ray places each replica's ranks on this many nodes.")
NODE_RANK = typer.Option(0, "--node-rank", min=0, help="This host's place among --nnodes (0: the scheduling one).")
MASTER_ADDR = typer.Option(None, "--master-addr",
                           help="With --nnodes: host 0's address, as the other hosts reach it.")
MASTER_PORT = typer.Option(29511, "--master-port", help="With --nnodes: the TCP port host 0 meets the others on.")

