"""RankDriver: rank 0 driving every rank's steps, as the executor of LLMEngine.

For each step rank 0 broadcasts the step metadata on the control group, runs its own program, and
takes the logits (its own all_gather's, or with pp > 1 the ones the last stage's first rank sends it).

With pp > 1 rank 0 keeps up to pp steps in flight (`submit` / `collect`, driven by LLMEngine.step):
it posts the receive of a step's logits, broadcasts the step without waiting, runs stage 0 and
returns while the later stages compute, so stage 0 runs step k + 1 while stage 1 runs step k. Every
rank takes the steps in the order rank 0 sent them, so the hidden states between stages and the
logits to rank 0 pair up in order. A gloo send waits for its receive, hence the receive is posted
first: the logits rank never waits on rank 0, which by then may be busy with a later step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from runtime.backends.base import Executor
from runtime.ranks import RankError
from runtime.ranks.collectives import broadcast_step
from runtime.ranks.rank import Rank
from runtime.ranks.rendezvous import is_peer_loss
from runtime.backends.step import StepMetadata


@dataclass
class InFlightStep:
    """A step rank 0 submitted: `logits` holds its logits once the works are done."""

    logits: torch.Tensor  # [N, vocab_size]
    works: list           # the receive of the logits, the step's broadcasts


class RankDriver(Executor):
    """Rank 0 (`rank`) running each step on every rank; a failure mid-step is a RankError naming the rank at fault."""

    def __init__(self, rank: Rank):
        self.rank = rank
        self.cache = rank.executor.cache
        self.max_in_flight = rank.engine.manifest.pp  # one step per stage
        self.vocab_size = rank.engine.manifest.vocab_size

    def execute(self, meta: StepMetadata) -> torch.Tensor:
        """Run one step on every rank and return its logits (with no step in flight)."""
        self._check_alive()
        try:
            broadcast_step(meta, self.rank.control)
            logits = self.rank.run_step(meta)
            if self.rank.logits_rank != 0:
                logits = torch.empty(meta.logits_indices.numel(), self.vocab_size)
                dist.recv(logits, self.rank.logits_rank)
            return logits
        except Exception as exc:  # noqa: BLE001 - any failure mid-step leaves the ranks out of step
            self._raise_step_failure(exc)

    def submit(self, meta: StepMetadata) -> InFlightStep:
        """Start a step (pp > 1) and return once stage 0 has run it; collect() steps in submission order."""
        self._check_alive()
        try:
            logits = torch.empty(meta.logits_indices.numel(), self.vocab_size)
            received = dist.irecv(logits, self.rank.logits_rank)  # first: see the module docstring
            broadcasts = broadcast_step(meta, self.rank.control, async_op=True)
            self.rank.run_step(meta)  # stage 0 ends by sending its hidden states to stage 1
            return InFlightStep(logits, [received, *broadcasts])
        except Exception as exc:  # noqa: BLE001
            self._raise_step_failure(exc)

    def collect(self, step: InFlightStep) -> torch.Tensor:
        """The logits of a submitted step, once the last stage has sent them."""
        try:
            for work in step.works:
                work.wait()
            return step.logits
        except Exception as exc:  # noqa: BLE001
            self._raise_step_failure(exc)

    def _check_alive(self) -> None:
        if self.rank.watchdog.failure:
            raise RankError(_stopped(self.rank.watchdog.failure))

    def _raise_step_failure(self, exc: Exception) -> NoReturn:
        """A failure mid-step as a RankError naming the rank at fault (the watchdog's finding on a peer's loss)."""
        detail = " ".join(str(exc).split())[:200]
        if not is_peer_loss(exc):
            raise RankError(_stopped(f"rank 0 failed in a step ({type(exc).__name__}: {detail})")) from exc
        watchdog = self.rank.watchdog
        failure = watchdog.wait_failure(grace=self.rank.timeout + 2 * watchdog.interval)
        raise RankError(_stopped(failure or f"a collective failed ({detail})")) from None


def _stopped(failure: str) -> str:
    return f"{failure}; stopped the other ranks"
