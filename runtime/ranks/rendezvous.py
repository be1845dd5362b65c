"""Rendezvous: how ranks find each other (a TCP store), wait for each other, and join torch.distributed."""

from __future__ import annotations

import datetime
import os
import subprocess
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from runtime.format.engine_format import EngineError
from runtime.ranks import RankError

STARTUP_TIMEOUT = 120.0  # seconds ranks get to start (import torch, map their file), at least


@dataclass(frozen=True)
class Rendezvous:
    rank: int
    world_size: int
    addr: str
    port: int
    host_store: bool   # this rank serves the TCP store the others connect to
    timeout: float     # seconds a rank may be silent before the others stop
    prefix: str = "kiln"  # of this run's keys in the store (torchrun's store outlives restarts)

    @staticmethod
    def from_env(timeout: float) -> Rendezvous | None:
        """torchrun's rendezvous, or None when this process was not started by torchrun."""
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            return None
        rank = int(os.environ["RANK"])
        # torchrun's agent serves the store itself; a plain env:// launch expects rank 0 to.
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        prefix = f"kiln/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}"
        return Rendezvous(rank, int(os.environ["WORLD_SIZE"]), os.environ.get("MASTER_ADDR", "127.0.0.1"),
                          int(os.environ["MASTER_PORT"]), rank == 0 and not agent_store, timeout, prefix)

    @property
    def startup_timeout(self) -> float:
        return max(self.timeout, STARTUP_TIMEOUT)

    def store(self, is_master: bool) -> dist.TCPStore:
        return dist.TCPStore(self.addr, self.port, self.world_size, is_master=is_master,
                             timeout=datetime.timedelta(seconds=self.startup_timeout), wait_for_workers=False)

    def report_failure(self, message: str) -> None:
        """A rank other than 0 that cannot open the engine: rank 0 names it and its reason."""
        self.store(False).set(f"{self.prefix}/failed/{self.rank}", message)

    def join(self, store, build_id: str, children: dict[int, subprocess.Popen]) -> None:
        """Say this rank opened engine build `build_id`; rank 0 waits for every rank; then join the process group."""
        store.set(f"{self.prefix}/joined/{self.rank}", build_id)
        if self.rank == 0:
            self._wait_for_ranks(store, children)
        # CPU tensors go over gloo; CUDA tensors (a GPU executor) would take NCCL through the same calls.
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=dist.PrefixStore(f"{self.prefix}/pg", store), rank=self.rank,
                                world_size=self.world_size, timeout=datetime.timedelta(seconds=self.timeout))

    def _wait_for_ranks(self, store, children: dict[int, subprocess.Popen]) -> None:
        """Rank 0: wait until every rank has opened the engine; one line naming a rank that cannot, or
        whose engine is another build, or whose local process exits while starting."""
        timeout, prefix = self.startup_timeout, self.prefix
        deadline = time.monotonic() + timeout
        ours = store.get(f"{prefix}/joined/0").decode()
        missing = list(range(1, self.world_size))
        while missing:
            for r in missing:
                if store.check([f"{prefix}/failed/{r}"]):
                    raise EngineError(f"rank {r}: {store.get(f'{prefix}/failed/{r}').decode()}")
                if r in children and children[r].poll() is not None:
                    raise RankError(f"rank {r} exited with status {children[r].returncode} while starting")
            joined = [r for r in missing if store.check([f"{prefix}/joined/{r}"])]
            for r in joined:
                if store.get(f"{prefix}/joined/{r}").decode() != ours:
                    raise EngineError(f"rank {r} opened a different engine build than rank 0; give every host "
                                      f"the same engine directory")
            missing = [r for r in missing if r not in joined]
            if missing and time.monotonic() > deadline:
                raise RankError(f"rank(s) {', '.join(map(str, missing))} did not start within {timeout:g} s")
            time.sleep(0.05)


def is_peer_loss(exc: BaseException) -> bool:
    """An error of the transport between ranks (gloo raises plain RuntimeErrors), not of this rank's work."""
    text = str(exc)
    return isinstance(exc, dist.DistError) or any(s in text for s in ("gloo", "Connection", "Timed out"))
