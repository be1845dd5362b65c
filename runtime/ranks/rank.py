"""Rank: this process's rank of a multi-rank engine: its engine, groups, watchdog and executor, and its step loop."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import subprocess
from pathlib import Path

import torch
import torch.distributed as dist

from runtime.backends import activations as host_activations
from runtime.backends.base import create_executor, kv_groups
from runtime.backends import backend as backend_module
from runtime.backends.gpus import rank_device
from runtime.format.engine_format import EngineDir, EngineError
from runtime.backends import open_engine
from runtime.format.mapping import Mapping
from runtime.ranks.collectives import Collectives, broadcast_step, receive_step
from runtime.ranks.rendezvous import Rendezvous, is_peer_loss
from runtime.ranks.watchdog import PEER_LOST, Watchdog
from runtime.backends.step import StepMetadata

FOREVER = datetime.timedelta(days=365)


class Rank:
    """One rank, joined with the others. Rank 0 drives the steps (runtime.ranks.driver); every other
    rank runs them in `serve()`."""

    def __init__(self, path: Path, rdzv: Rendezvous, kv_cache_gib: float | None, check_hashes: bool,
                 children: dict[int, subprocess.Popen] | None = None, store=None, backend: str | None = None,
                 activations: str | None = None):
        self.rank, self.world_size, self.timeout = rdzv.rank, rdzv.world_size, rdzv.timeout
        self.children = children or {}
        self.watchdog: Watchdog | None = None
        self.engine = self._open(path, rdzv, check_hashes, backend)
        self.backend = self.engine.backend
        self.store = store or rdzv.store(rdzv.host_store)
        rdzv.join(self.store, self.engine.manifest.build_id, self.children)
        try:
            self.watchdog = Watchdog(rdzv.addr, rdzv.port, f"{rdzv.prefix}/watchdog", self.rank, self.world_size,
                                     rdzv.timeout, self.children, self._kill_children)
            self._build(kv_cache_gib, activations)
        except BaseException:
            self.close(stop_others=False)
            raise

    def _open(self, path: Path, rdzv: Rendezvous, check_hashes: bool, backend: str | None) -> EngineDir:
        """Bad input (missing rank file, other world size, corrupt file) stops every rank before any computes."""
        try:
            return open_engine(path, world_size=self.world_size, check_hashes=check_hashes, backend=backend)
        except (EngineError, OSError, ValueError) as exc:
            if self.rank != 0:  # rank 0 names this rank and its reason
                with contextlib.suppress(Exception):
                    rdzv.report_failure(str(exc))
            raise EngineError(str(exc)) from None

    def _build(self, kv_cache_gib: float | None, activations: str | None) -> None:
        """activations: rank 0's --activations; rank 0 chooses the path (runtime/backends/activations.py) and every rank
        runs it."""
        manifest = self.engine.manifest
        mapping = Mapping(manifest.group, manifest.pp, self.rank)
        # Rank 0 waits on workers within a step, and workers wait on rank 0 between steps for as long
        # as it idles: the control group has no deadline, the heartbeats bound that wait instead.
        self.control = dist.new_group(backend="gloo", timeout=FOREVER)
        # Every rank creates every stage's group, in the same order (torch.distributed requires it).
        stage_ranks = mapping.tp_groups()
        stages = [dist.new_group(ranks) for ranks in stage_ranks]
        device = None
        if backend_module(self.backend).GPU:  # NCCL needs each rank's GPU chosen before its first collective
            device = rank_device(self.rank)
            torch.cuda.set_device(device)
        self.collectives = Collectives(self.rank, mapping.tp_group(), stages[mapping.pp_rank], device)
        config = [None, None]
        if self.rank == 0:
            config = [kv_groups(manifest, self.backend, kv_cache_gib),
                      host_activations.for_host(self.engine, backend_module(self.backend),
                                                 activations).activation_choice]
        dist.broadcast_object_list(config, 0, group=self.control)
        self.engine = dataclasses.replace(self.engine, activation_choice=config[1])
        self.executor = create_executor(self.engine, self.rank, config[0], self.backend,
                                        collectives=self.collectives.hooks())
        self.logits_rank = stage_ranks[-1][0]  # the last stage's first rank holds the gathered logits
        dist.barrier(group=self.control)

    def run_step(self, meta: StepMetadata):
        """This rank's share of a step: the logits on the logits rank, else None."""
        self.collectives.num_tokens, self.collectives.num_logits = meta.token_ids.numel(), meta.logits_indices.numel()
        return self.executor.execute(meta)

    def serve(self) -> int:
        """Ranks other than 0: run rank 0's steps until it says stop; the process exit status."""
        gc.freeze()  # the engine is open: what is alive now lives as long as this process (launcher.settled)
        try:
            while (meta := receive_step(self.control)) is not None:
                logits = self.run_step(meta)
                if self.rank == self.logits_rank:
                    dist.send(logits.contiguous(), 0)
        except Exception as exc:  # noqa: BLE001 - ends this rank; rank 0 names it and stops the others
            if is_peer_loss(exc):
                return PEER_LOST
            self.watchdog.report_error(f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
            return 1
        return 0

    def _kill_children(self, reason: str) -> None:
        for child in self.children.values():
            if child.poll() is None:
                child.kill()

    def close(self, stop_others: bool) -> None:
        """Leave: rank 0 tells the others to stop (on a clean exit) before the groups go."""
        if stop_others and self.rank == 0 and self.watchdog and self.watchdog.failure is None:
            with contextlib.suppress(RuntimeError):
                broadcast_step(None, self.control)
        if self.watchdog is not None:
            self.watchdog.stop()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
