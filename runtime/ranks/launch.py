"""Starting rank processes: rank 0 of a local launch starts ranks 1..W-1 and reaps them (a host of a multi-host
launch, its own share); `main` is such a rank."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from runtime.backends.cpu.cpus import usable_cpus
from runtime.format.engine_format import EngineError
from runtime.ranks.rank import Rank
from runtime.ranks.rendezvous import Rendezvous, is_peer_loss
from runtime.ranks.watchdog import PEER_LOST


@contextlib.contextmanager
def start_ranks(path: Path, world_size: int, timeout: float, kv_cache_gib: float | None = None,
                num_threads: int | None = None, check_hashes: bool = True, rdzv: Rendezvous | None = None,
                backend: str | None = None, activations: str | None = None, local_ranks: int = 1):
    """This process's Rank. Without `rdzv` it is rank 0 of a local launch and starts ranks 1..W-1 as child
    processes; with `rdzv` and `local_ranks` > 1 (a host's share of a multi-host launch, runtime/ranks/nodes.py)
    it starts ranks rdzv.rank + 1 .. rdzv.rank + local_ranks - 1 the same way. On leaving, the children are
    stopped and reaped, never left behind."""
    children: dict[int, subprocess.Popen] = {}
    store, threads_before, spawn = None, torch.get_num_threads(), range(0)
    if rdzv is None:
        store = Rendezvous(0, world_size, "127.0.0.1", 0, True, timeout).store(True)  # port 0: the system picks one
        rdzv = Rendezvous(0, world_size, "127.0.0.1", store.port, True, timeout)
        spawn = range(1, world_size)
    elif local_ranks > 1:
        spawn = range(rdzv.rank + 1, rdzv.rank + local_ranks)
    if spawn:
        threads = num_threads or max(1, usable_cpus() // (len(spawn) + 1))  # this host's ranks share its cores
        torch.set_num_threads(threads)
        for r in spawn:
            children[r] = subprocess.Popen(
                [sys.executable, "-m", "runtime.ranks.launch", str(path), "--rank", str(r), "--world-size",
                 str(world_size), "--addr", rdzv.addr, "--port", str(rdzv.port), "--rank-timeout", str(timeout),
                 "--threads", str(threads), "--parent", str(os.getpid()),
                 *(["--backend", backend] if backend else [])],
                stdout=subprocess.DEVNULL)
    elif num_threads:
        torch.set_num_threads(num_threads)
    rank, clean = None, False
    try:
        rank = Rank(path, rdzv, kv_cache_gib, check_hashes and not children, children, store, backend, activations)
        yield rank
        clean = True
    finally:
        if rank is not None:
            rank.close(stop_others=clean)
        _reap(children, wait=5.0 if clean else 0.0)
        torch.set_num_threads(threads_before)


def _reap(children: dict[int, subprocess.Popen], wait: float) -> None:
    for child in children.values():
        try:
            child.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass
        if child.poll() is None:
            child.kill()
            child.wait()


def _die_with_parent(parent: int) -> None:
    """Linux: this process gets SIGKILL when its parent (rank 0) dies, however it dies."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(PEER_LOST)
    # Ctrl-C reaches the whole process group; rank 0 alone decides how the ranks stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def main(argv: list[str] | None = None) -> int:
    """A local rank process (started by start_ranks; not a user command)."""
    parser = argparse.ArgumentParser(prog="python -m runtime.ranks.launch")
    parser.add_argument("engine", type=Path)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--addr", default="127.0.0.1", help="the rendezvous store's host (rank 0's)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--rank-timeout", type=float, required=True)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--backend", default=None)
    args = parser.parse_args(argv)
    _die_with_parent(args.parent)
    if args.threads:
        torch.set_num_threads(args.threads)
    rdzv = Rendezvous(args.rank, args.world_size, args.addr, args.port, False, args.rank_timeout)
    try:
        with start_ranks(args.engine, args.world_size, args.rank_timeout, check_hashes=False, rdzv=rdzv,
                         backend=args.backend) as rank:
            return rank.serve()
    except EngineError:
        return 1  # rank 0 found the same problem and reports it
    except RuntimeError as exc:
        if os.environ.get("KILN_DEBUG"):
            raise
        return PEER_LOST if is_peer_loss(exc) else 1


if __name__ == "__main__":
    sys.exit(main())
