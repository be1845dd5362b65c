"""Open an engine for serving: one rank in this process, or (multi-rank engines) one process per rank.

A multi-rank engine started by `engine-run` makes this process rank 0 (the scheduler) and starts the
other ranks as child processes on this host; with --nnodes each host starts its own share
(runtime/ranks/nodes.py). Under torchrun every process calls this. Rank 0 gets the LLMEngine, and every other
rank serves rank 0's steps here and then exits the process.
"""

from __future__ import annotations

import contextlib
import gc
from pathlib import Path

from runtime.backends import open_engine
from runtime.backends.base import for_host
from runtime.core.engine import EngineOptions, LLMEngine
from runtime.format.engine_format import EngineError
from runtime.ranks.driver import RankDriver
from runtime.ranks.launch import start_ranks
from runtime.ranks.nodes import Nodes, use_route_to
from runtime.ranks.rendezvous import Rendezvous


@contextlib.contextmanager
def open_llm_engine(path: str | Path, options: EngineOptions = EngineOptions(), nodes: Nodes | None = None):
    """nodes: this host's place in a multi-host launch (runtime/ranks/nodes.py); on any host but 0 the process
    serves rank 0's steps and exits (SystemExit) when rank 0 stops."""
    if options.rank_timeout <= 0:
        raise EngineError(f"--rank-timeout {options.rank_timeout:g}: must be a positive number of seconds")
    rdzv = Rendezvous.from_env(options.rank_timeout)
    if nodes is not None:
        if rdzv is not None:
            raise EngineError("--nnodes starts this host's ranks itself: run engine-run without torchrun")
        engine_dir = open_engine(path, check_hashes=options.check_hashes, backend=options.backend)  # this host's copy
        world_size = engine_dir.manifest.world_size
        local = nodes.per_host(world_size)
        use_route_to(nodes.master_addr)
        yield from _multi_rank(Path(path), world_size, options, nodes.rendezvous(world_size, options.rank_timeout),
                               local)
        return
    if rdzv is None or rdzv.world_size == 1:
        # Every bad input is found here, before a rank process starts: missing rank files, world size, hashes.
        engine_dir = open_engine(path, world_size=1 if rdzv else None, check_hashes=options.check_hashes,
                                 backend=options.backend)
        if engine_dir.manifest.world_size == 1:
            yield settled(LLMEngine(engine_dir, options))
            return
        if options.activations is not None:  # refused here, before any rank starts
            for_host(engine_dir, engine_dir.backend, options.activations)
        world_size = engine_dir.manifest.world_size
    else:
        world_size = rdzv.world_size
    yield from _multi_rank(Path(path), world_size, options, rdzv)


def settled(engine):
    """`engine`, once the process has frozen what is alive now (weights' wrappers, tokenizer, caches'
    bookkeeping) out of the cyclic collector's reach: they live as long as the engine, and full collections
    then scan only what requests make. Without it, gc_collect_main took 2-3% of an offline 32-request run's
    CPU samples and 6.4% of a server's under guidellm."""
    gc.freeze()
    return engine


def _multi_rank(path: Path, world_size: int, options: EngineOptions, rdzv, local_ranks: int = 1):
    worker = rdzv is not None and rdzv.rank != 0
    try:
        with start_ranks(path, world_size, options.rank_timeout, kv_cache_gib=options.kv_cache_gib,
                         num_threads=options.num_threads, check_hashes=options.check_hashes, rdzv=rdzv,
                         backend=options.backend, activations=options.activations, local_ranks=local_ranks) as rank:
            if worker:  # torchrun, or a host other than 0: this process is only ever a rank worker
                raise SystemExit(rank.serve())
            yield settled(LLMEngine(rank.engine, options, executor=RankDriver(rank)))
    except EngineError:
        if worker:
            raise SystemExit(1) from None  # rank 0 reports the same problem, in one line
        raise


def host_group(nnodes: int, node_rank: int, master_addr: str | None, master_port: int, engine, options: EngineOptions):
    """The Nodes of a multi-host launch (None for one host: --nnodes 1). On a host other than 0 this runs its ranks
    until host 0 stops, then exits the process with their status: that host has nothing else to do."""
    if nnodes == 1:
        if node_rank:
            raise EngineError(f"--node-rank {node_rank} needs --nnodes above 1")
        return None
    if not master_addr:
        raise EngineError("--nnodes needs --master-addr: host 0's address, the same on every host")
    nodes = Nodes(nnodes, node_rank, master_addr, master_port)
    if node_rank > 0:
        with open_llm_engine(engine, options, nodes):  # a worker host's ranks serve, then raise SystemExit
            raise EngineError("a worker host of a rank group was handed the engine")  # not reached
    return nodes
