"""Ranks as processes: start them, join them over torch.distributed, drive their steps from rank 0.

Every rank runs its own program (rank{r}.engine) over the same steps and owns the KV cache of its
heads and layers. Rank 0 runs the scheduler: for each step it broadcasts the step metadata on the
control group (runtime.collectives), runs its own program, and takes the logits (its own
all_gather's, or with pp > 1 the ones the last stage's first rank sends it). Every other rank loops:
receive a step, run it, and send the logits to rank 0 if it is the last stage's first rank.

With pp > 1 rank 0 keeps up to pp steps in flight (`submit` / `collect`, driven by LLMEngine.step):
it posts the receive of a step's logits, broadcasts the step without waiting, runs stage 0 and
returns while the later stages compute, so stage 0 runs step k + 1 while stage 1 runs step k. Every
rank takes the steps in the order rank 0 sent them, so the hidden states between stages and the
logits to rank 0 pair up in order. A gloo send waits for its receive, hence the receive is posted
first: the logits rank never waits on rank 0, which by then may be busy with a later step.

Ranks are numbered stage-major, rank = pp_rank * tp + tp_rank (the builder's Mapping). Groups: one
per pipeline stage (its tp ranks' all_reduce and all_gather), the default group (send/recv between
stages, the logits to rank 0), and a gloo control group (the step broadcast).

Started locally by `engine-run` (runtime.launcher: this process is rank 0 and starts the others
with `python -m runtime.distributed`), or on every host by torchrun (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT from the environment). Before any rank computes, every rank opens the engine and rank 0
waits until all have: a missing rank file, another world size or another build is one line naming
the rank. A rank that dies or hangs later is named by the watchdog (runtime.watchdog).
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from runtime.collectives import Collectives, broadcast_step, receive_step
from runtime.engine_dir import EngineDir, EngineError, open_engine
from runtime.executor import Executor
from runtime.step import StepMetadata
from runtime.watchdog import PEER_LOST, Watchdog

FOREVER = datetime.timedelta(days=365)
STARTUP_TIMEOUT = 120.0  # seconds ranks get to start (import torch, map their file), at least


class RankError(EngineError):
    """A rank died, hung or failed, so the engine cannot go on; LLMEngine.step re-raises it."""

    fatal = True


@dataclass
class InFlightStep:
    """A step rank 0 submitted: `logits` holds its logits once the works are done."""

    logits: torch.Tensor  # [N, vocab_size]
    works: list           # the receive of the logits, the step's broadcasts


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


# ---------------------------------------------------------------------- one rank

def shared_num_blocks(engine: EngineDir, kv_cache_gib: float | None) -> int:
    """KV blocks every rank allocates (the scheduler hands out one block id space): the fewest any rank fits."""
    ranks = engine.manifest["memory"]["ranks"]
    if kv_cache_gib is None:
        return min(m["kv_blocks"] for m in ranks)
    block_size = engine.plan["kv_cache"]["block_size"]
    blocks = min(int(kv_cache_gib * (1 << 30) // (m["kv_bytes_per_token"] * block_size)) for m in ranks
                 if m["kv_bytes_per_token"])
    if blocks < 1:
        raise EngineError(f"kv_cache_gib={kv_cache_gib} holds no KV block on some rank; raise it")
    return blocks


class Rank:
    """This process's rank: its engine, groups, watchdog and executor; rank 0 also drives the steps."""

    def __init__(self, path: Path, rdzv: Rendezvous, kv_cache_gib: float | None, check_hashes: bool,
                 children: dict[int, subprocess.Popen] | None = None, store=None):
        self.rank, self.world_size, self.timeout = rdzv.rank, rdzv.world_size, rdzv.timeout
        self.children = children or {}
        self.watchdog: Watchdog | None = None
        startup = max(rdzv.timeout, STARTUP_TIMEOUT)
        self.engine = self._open(path, rdzv, check_hashes, startup)
        self.store = store or _store(rdzv, rdzv.host_store, startup)
        self._join(rdzv, startup)
        try:
            self.watchdog = Watchdog(rdzv.addr, rdzv.port, f"{rdzv.prefix}/watchdog", self.rank, self.world_size,
                                     rdzv.timeout, self.children, self._kill_children)
            self._build(kv_cache_gib)
        except BaseException:
            self.close(stop_others=False)
            raise

    def _open(self, path: Path, rdzv: Rendezvous, check_hashes: bool, startup: float) -> EngineDir:
        """Bad input (missing rank file, other world size, corrupt file) stops every rank before any computes."""
        try:
            return open_engine(path, world_size=self.world_size, check_hashes=check_hashes)
        except (EngineError, OSError, ValueError) as exc:
            if self.rank != 0:  # rank 0 names this rank and its reason
                with contextlib.suppress(Exception):
                    _store(rdzv, False, startup).set(f"{rdzv.prefix}/failed/{self.rank}", str(exc))
            raise EngineError(str(exc)) from None

    def _join(self, rdzv: Rendezvous, startup: float) -> None:
        self.store.set(f"{rdzv.prefix}/joined/{self.rank}", self.engine.manifest["build_id"])
        if self.rank == 0:
            _wait_for_ranks(self.store, rdzv, self.children, startup)
        # CPU tensors go over gloo; CUDA tensors (a GPU executor) would take NCCL through the same calls.
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=dist.PrefixStore(f"{rdzv.prefix}/pg", self.store), rank=self.rank,
                                world_size=self.world_size, timeout=datetime.timedelta(seconds=rdzv.timeout))

    def _build(self, kv_cache_gib: float | None) -> None:
        plan = self.engine.plan
        tp, pp = plan["tp"], plan["pp"]
        # Rank 0 waits on workers within a step, and workers wait on rank 0 between steps for as long
        # as it idles: the control group has no deadline, the heartbeats bound that wait instead.
        self.control = dist.new_group(backend="gloo", timeout=FOREVER)
        # Every rank creates every stage's group, in the same order (torch.distributed requires it).
        stage_ranks = [[p * tp + t for t in range(tp)] for p in range(pp)]
        stages = [dist.new_group(ranks) for ranks in stage_ranks]
        self.collectives = Collectives(self.rank, stage_ranks[self.rank // tp], stages[self.rank // tp])
        config = [shared_num_blocks(self.engine, kv_cache_gib) if self.rank == 0 else None]
        dist.broadcast_object_list(config, 0, group=self.control)
        self.executor = Executor(self.engine.load_rank(self.rank), config[0], plan["kv_cache"]["block_size"],
                                 plan["kv_cache"]["dtype"], collectives=self.collectives.hooks())
        self.cache = self.executor.cache
        self.logits_rank = (pp - 1) * tp  # the last stage's first rank holds the gathered logits
        self.max_in_flight = pp  # steps LLMEngine keeps in flight through submit / collect (one per stage)
        self.vocab_size = self.engine.manifest["model"]["config"]["vocab_size"]
        dist.barrier(group=self.control)

    # ------------------------------------------------------------------ rank 0: the executor of LLMEngine

    def execute(self, meta: StepMetadata) -> torch.Tensor:
        """Run one step on every rank and return its logits (with no step in flight)."""
        self._check_alive()
        try:
            broadcast_step(meta, self.control)
            logits = self._run(meta)
            if self.logits_rank != 0:
                logits = torch.empty(meta.logits_indices.numel(), self.vocab_size)
                dist.recv(logits, self.logits_rank)
            return logits
        except Exception as exc:  # noqa: BLE001 - any failure mid-step leaves the ranks out of step
            self._raise_step_failure(exc)

    def submit(self, meta: StepMetadata) -> InFlightStep:
        """Start a step (pp > 1) and return once stage 0 has run it; collect() steps in submission order."""
        self._check_alive()
        try:
            logits = torch.empty(meta.logits_indices.numel(), self.vocab_size)
            received = dist.irecv(logits, self.logits_rank)  # first: see the module docstring
            broadcasts = broadcast_step(meta, self.control, async_op=True)
            self._run(meta)  # stage 0 ends by sending its hidden states to stage 1
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
        if self.watchdog.failure:
            raise RankError(self._stopped(self.watchdog.failure))

    def _raise_step_failure(self, exc: Exception) -> NoReturn:
        """A failure mid-step as a RankError naming the rank at fault (the watchdog's finding on a peer's loss)."""
        detail = " ".join(str(exc).split())[:200]
        if not _is_peer_loss(exc):
            raise RankError(self._stopped(f"rank 0 failed in a step ({type(exc).__name__}: {detail})")) from exc
        failure = self.watchdog.wait_failure(grace=self.timeout + 2 * self.watchdog.interval)
        raise RankError(self._stopped(failure or f"a collective failed ({detail})")) from None

    def _run(self, meta: StepMetadata) -> torch.Tensor | None:
        self.collectives.num_tokens, self.collectives.num_logits = meta.token_ids.numel(), meta.logits_indices.numel()
        return self.executor.execute(meta)

    def _stopped(self, failure: str) -> str:
        return f"{failure}; stopped the other ranks"

    def _kill_children(self, reason: str) -> None:
        for child in self.children.values():
            if child.poll() is None:
                child.kill()

    # ------------------------------------------------------------------ the other ranks

    def serve(self) -> int:
        """Run rank 0's steps until it says stop; the process exit status."""
        try:
            while (meta := receive_step(self.control)) is not None:
                logits = self._run(meta)
                if self.rank == self.logits_rank:
                    dist.send(logits.contiguous(), 0)
        except Exception as exc:  # noqa: BLE001 - ends this rank; rank 0 names it and stops the others
            if _is_peer_loss(exc):
                return PEER_LOST
            self.watchdog.report_error(f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
            return 1
        return 0

    def close(self, stop_others: bool) -> None:
        """Leave: rank 0 tells the others to stop (on a clean exit) before the groups go."""
        if stop_others and self.rank == 0 and self.watchdog and self.watchdog.failure is None:
            with contextlib.suppress(RuntimeError):
                broadcast_step(None, self.control)
        if self.watchdog is not None:
            self.watchdog.stop()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _store(rdzv: Rendezvous, is_master: bool, timeout: float):
    return dist.TCPStore(rdzv.addr, rdzv.port, rdzv.world_size, is_master=is_master,
                         timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)


def _wait_for_ranks(store, rdzv: Rendezvous, children: dict[int, subprocess.Popen], timeout: float) -> None:
    """Rank 0: wait until every rank has opened the engine; one line naming a rank that cannot, or
    whose engine is another build, or whose local process exits while starting."""
    deadline = time.monotonic() + timeout
    ours = store.get(f"{rdzv.prefix}/joined/0").decode()
    missing = list(range(1, rdzv.world_size))
    while missing:
        for r in missing:
            if store.check([f"{rdzv.prefix}/failed/{r}"]):
                raise EngineError(f"rank {r}: {store.get(f'{rdzv.prefix}/failed/{r}').decode()}")
            if r in children and children[r].poll() is not None:
                raise RankError(f"rank {r} exited with status {children[r].returncode} while starting")
        joined = [r for r in missing if store.check([f"{rdzv.prefix}/joined/{r}"])]
        for r in joined:
            if store.get(f"{rdzv.prefix}/joined/{r}").decode() != ours:
                raise EngineError(f"rank {r} opened a different engine build than rank 0; give every host "
                                  f"the same engine directory")
        missing = [r for r in missing if r not in joined]
        if missing and time.monotonic() > deadline:
            raise RankError(f"rank(s) {', '.join(map(str, missing))} did not start within {timeout:g} s")
        time.sleep(0.05)


def _is_peer_loss(exc: BaseException) -> bool:
    """An error of the transport between ranks (gloo raises plain RuntimeErrors), not of this rank's work."""
    text = str(exc)
    return isinstance(exc, dist.DistError) or any(s in text for s in ("gloo", "Connection", "Timed out"))


# ---------------------------------------------------------------------- starting ranks

@contextlib.contextmanager
def start_ranks(path: Path, world_size: int, timeout: float, kv_cache_gib: float | None = None,
                num_threads: int | None = None, check_hashes: bool = True, rdzv: Rendezvous | None = None):
    """This process's Rank. Without `rdzv` it is rank 0 of a local launch and starts ranks 1..W-1 as
    child processes; on leaving, the children are stopped and reaped, never left behind."""
    children: dict[int, subprocess.Popen] = {}
    store, threads_before = None, torch.get_num_threads()
    if rdzv is None:
        store = _store(Rendezvous(0, world_size, "127.0.0.1", 0, True, timeout), True,
                       max(timeout, STARTUP_TIMEOUT))  # port 0: the system picks a free one
        rdzv = Rendezvous(0, world_size, "127.0.0.1", store.port, True, timeout)
        threads = num_threads or max(1, (os.cpu_count() or 1) // world_size)  # ranks share this host's cores
        torch.set_num_threads(threads)
        for r in range(1, world_size):
            children[r] = subprocess.Popen(
                [sys.executable, "-m", "runtime.distributed", str(path), "--rank", str(r), "--world-size",
                 str(world_size), "--port", str(store.port), "--rank-timeout", str(timeout), "--threads",
                 str(threads), "--parent", str(os.getpid())], stdout=subprocess.DEVNULL)
    elif num_threads:
        torch.set_num_threads(num_threads)
    rank, clean = None, False
    try:
        rank = Rank(path, rdzv, kv_cache_gib, check_hashes and not children, children, store)
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
    parser = argparse.ArgumentParser(prog="python -m runtime.distributed")
    parser.add_argument("engine", type=Path)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--rank-timeout", type=float, required=True)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--parent", type=int, required=True)
    args = parser.parse_args(argv)
    _die_with_parent(args.parent)
    if args.threads:
        torch.set_num_threads(args.threads)
    rdzv = Rendezvous(args.rank, args.world_size, "127.0.0.1", args.port, False, args.rank_timeout)
    try:
        with start_ranks(args.engine, args.world_size, args.rank_timeout, check_hashes=False, rdzv=rdzv) as rank:
            return rank.serve()
    except EngineError:
        return 1  # rank 0 found the same problem and reports it
    except RuntimeError as exc:
        if os.environ.get("KILN_DEBUG"):
            raise
        return PEER_LOST if _is_peer_loss(exc) else 1


if __name__ == "__main__":
    sys.exit(main())
