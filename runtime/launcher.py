"""Open an engine for serving: one rank in this process, or (multi-rank engines) one process per rank.

A multi-rank engine started by `engine-run` makes this process rank 0 (the scheduler) and starts the
other ranks as child processes on this host. Under torchrun every process calls this: rank 0 gets
the LLMEngine, and every other rank serves rank 0's steps here and then exits the process.
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
from runtime.ranks.rendezvous import Rendezvous


@contextlib.contextmanager
def open_llm_engine(path: str | Path, options: EngineOptions = EngineOptions()):
    if options.rank_timeout <= 0:
        raise EngineError(f"--rank-timeout {options.rank_timeout:g}: must be a positive number of seconds")
    rdzv = Rendezvous.from_env(options.rank_timeout)
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


def _multi_rank(path: Path, world_size: int, options: EngineOptions, rdzv):
    worker = rdzv is not None and rdzv.rank != 0
    try:
        with start_ranks(path, world_size, options.rank_timeout, kv_cache_gib=options.kv_cache_gib,
                         num_threads=options.num_threads, check_hashes=options.check_hashes, rdzv=rdzv,
                         backend=options.backend, activations=options.activations) as rank:
            if worker:  # torchrun: this process is only ever a rank worker
                raise SystemExit(rank.serve())
            yield settled(LLMEngine(rank.engine, options, executor=RankDriver(rank)))
    except EngineError:
        if worker:
            raise SystemExit(1) from None  # rank 0 reports the same problem, in one line
        raise
