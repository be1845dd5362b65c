"""Watchdog: heartbeats in the rendezvous store, so a dead or hung rank is named within the rank timeout.

Every rank stamps `beat/<rank>` about ten times per timeout from a daemon thread (the thread keeps
beating while the main thread waits in a collective, and stops when the process is stopped or dead).
Rank 0 watches every other rank: a beat that does not change for `timeout` seconds, or a local rank
process that exited, is a failure; it records the first one, posts `abort` and calls `on_failure`.
The other ranks watch rank 0's beat and `abort`, and leave at once (exit code PEER_LOST) when rank 0
is gone or asks them to.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

PEER_LOST = 3  # exit status of a rank that stopped because another rank failed


class Watchdog:
    def __init__(self, addr: str, port: int, prefix: str, rank: int, world_size: int, timeout: float,
                 children: dict[int, subprocess.Popen] | None = None,
                 on_failure: Callable[[str], None] | None = None):
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.interval = min(1.0, timeout / 10)
        self.children = children or {}
        self.on_failure = on_failure
        self.failure: str | None = None
        self._failed = threading.Event()
        self._stop = threading.Event()
        # A connection of its own: the main thread's store client may be busy in a collective's setup.
        self.store = dist.PrefixStore(prefix, dist.TCPStore(
            addr, port, world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout)))
        self._seen = {r: ("", time.monotonic()) for r in range(world_size) if r != rank}
        self.store.set(f"beat/{rank}", "0")
        self._thread = threading.Thread(target=self._run, name=f"kiln-watchdog-{rank}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.interval + 1)

    def abort(self, reason: str) -> None:
        """Ask every rank to leave now (rank 0, on a failure it found itself)."""
        try:
            self.store.set("abort", reason)
        except Exception:  # the store is gone: the ranks are leaving anyway
            pass

    def wait_failure(self, grace: float) -> str | None:
        """The failure the watchdog names, waiting up to `grace` seconds for it to be found."""
        self._failed.wait(grace)
        return self.failure

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        beat = 0
        while not self._stop.wait(self.interval):
            beat += 1
            try:
                self.store.set(f"beat/{self.rank}", str(beat))
                if self.rank == 0:
                    self._watch_ranks()
                else:
                    self._watch_rank0()
            except Exception as exc:  # noqa: BLE001 - the store itself is gone
                if self.rank != 0:
                    _leave(f"rank {self.rank}: lost the rendezvous store ({exc})")
                self._fail(f"the rendezvous store failed ({exc})")
                return

    def _watch_ranks(self) -> None:
        if self.failure is not None:
            return
        exited = {r: p.returncode for r, p in self.children.items() if p.poll() is not None}
        failed = {r: code for r, code in exited.items() if code != 0}
        if failed:
            own = [r for r, code in failed.items() if code != PEER_LOST] or sorted(failed)
            self._fail(self._exit_reason(own[0], failed[own[0]]))
            return
        now = time.monotonic()
        for rank, (last, since) in self._seen.items():
            value = self.store.get(f"beat/{rank}").decode() if self.store.check([f"beat/{rank}"]) else ""
            if value != last:
                self._seen[rank] = (value, now)
            elif rank not in exited and now - since > self.timeout:
                self._fail(f"rank {rank} stopped responding for {self.timeout:g} s (hung or unreachable)")
                return

    def _watch_rank0(self) -> None:
        if self.store.check(["abort"]):
            _leave(None)
        last, since = self._seen[0]
        value = self.store.get("beat/0").decode()
        now = time.monotonic()
        if value != last:
            self._seen[0] = (value, now)
        elif now - since > self.timeout:
            _leave(f"rank {self.rank}: rank 0 stopped responding for {self.timeout:g} s")

    def _exit_reason(self, rank: int, code: int) -> str:
        message = ""
        if self.store.check([f"error/{rank}"]):
            message = ": " + self.store.get(f"error/{rank}").decode()
        if code < 0:
            return f"rank {rank} died (killed by {signal.Signals(-code).name}){message}"
        return f"rank {rank} exited with status {code}{message}"

    def _fail(self, reason: str) -> None:
        if self.failure is not None:
            return
        self.failure = reason
        self._failed.set()
        self.abort(reason)
        if self.on_failure is not None:
            self.on_failure(reason)

    def report_error(self, message: str) -> None:
        """Leave this rank's own error where rank 0 reads it when naming the failure."""
        try:
            self.store.set(f"error/{self.rank}", message)
        except Exception:  # noqa: BLE001
            pass


def _leave(reason: str | None) -> None:
    """End a non-zero rank now: another rank failed, and rank 0 reports it."""
    if reason and os.environ.get("KILN_DEBUG"):
        print(reason, file=sys.stderr, flush=True)
    os._exit(PEER_LOST)
