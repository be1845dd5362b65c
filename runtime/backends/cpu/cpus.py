"""How many CPUs this process may really use, and how many it really gets.

`usable_cpus`: the affinity mask, capped by the cgroup's CPU quota. OpenMP and torch count the CPUs
in the affinity mask. A container limited by a CPU quota (cgroup v2 `cpu.max`, v1
`cpu.cfs_quota_us` / `cpu.cfs_period_us`) sees every CPU of the host but gets only quota / period of
them; more kernel threads than that are throttled in turn, and every kernel of a step waits for the
last of them.

`ThreadGovernor`: what the other processes leave. Every kernel of a step splits its work across
the threads and waits for the last of them; when another process holds one of the cores, the
thread that shares it runs in turns of a few milliseconds and every kernel waits for its turn. On
2 cores with one kept busy, a 2-thread decode ran 6-8x slower than on a quiet machine, and a
1-thread decode on the free core 1.7-1.9x slower (measured, interleaved runs). So the governor
watches, a few times a second, how much of this process's CPUs were idle or its own, and caps the
kernels' threads at that many; it lifts the cap once the CPUs are free again.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Iterator

from runtime._native import _ops

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC = Path("/proc")

log = logging.getLogger(__name__)


def cgroup_cpu_limit(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs the cgroup quota allows (quota / period), or None when there is no quota or no cgroup."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]  # v2: "max 100000" or "150000 100000"
    except (OSError, ValueError):
        try:  # v1
            quota = (root / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (root / "cpu" / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    try:
        quota_us, period_us = int(quota), int(period)
    except ValueError:  # "max": no quota
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def usable_cpus(root: Path = CGROUP_ROOT) -> int:
    """CPUs in the affinity mask, at most the cgroup quota rounded up; at least 1."""
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        count = os.cpu_count() or 1
    limit = cgroup_cpu_limit(root)
    if limit is not None:
        count = min(count, math.ceil(limit))
    return max(1, count)


# ---------------------------------------------------------------------------------------------
# The thread governor


@dataclass(frozen=True)
class CpuTimes:
    """Clock ticks since boot: of the CPUs in this process's affinity mask, and of this process."""

    at: float     # time.monotonic() when read
    idle: int     # idle + iowait of those CPUs
    total: int    # every state of those CPUs (steal included: time the hypervisor gave away)
    own: int      # this process's user + system time, all its threads


def read_cpu_times(cpus: list[int], proc: Path = PROC) -> CpuTimes | None:
    """The ticks now, or None where /proc cannot tell (not Linux)."""
    try:
        stat = (proc / "stat").read_text()
        own = (proc / "self" / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    wanted = {f"cpu{c}" for c in cpus}
    idle = total = 0
    for line in stat.splitlines():
        name, _, rest = line.partition(" ")
        if name in wanted:
            ticks = [int(v) for v in rest.split()[:8]]  # user nice system idle iowait irq softirq steal
            idle += ticks[3] + ticks[4]
            total += sum(ticks)                          # (guest time is inside user already)
    # after the ")" that ends the command name, fields 14 and 15 (utime, stime) are items 11 and 12
    return CpuTimes(time.monotonic(), idle, total, int(own[11]) + int(own[12]))


def free_cpus(before: CpuTimes, after: CpuTimes, count: int) -> float | None:
    """CPUs (of `count`) that were idle or this process's own between two readings; None if no time passed."""
    per_cpu = (after.total - before.total) / count
    if per_cpu <= 0:
        return None
    return (after.idle - before.idle + after.own - before.own) / per_cpu


class ThreadGovernor:
    """Caps the threads of every Kiln kernel in this process at what runs fastest beside other processes.

    `tick()` is called once a step; every `interval` seconds it reads /proc (after more than `interval`
    from one step's end to the next step it only reads afresh: while this process was idle, other
    processes' work is not contention). While the CPUs that were idle or this process's own add up to
    all of them (within HEADROOM), the cap is lifted. When they fall short in DROP_AFTER readings in a row, another process
    holds CPUs: contention starts, at the count the last try kept if one has decided (a client busy now
    and then starts contention again and again), else at the CPUs those readings left on average,
    rounded up from 0.5 (one short reading, a client's burst of a quarter second, starts nothing). Which
    count is then fastest depends on the contention: beside one busy core of two, one thread decoded 4-8x
    faster than two; with both cores busy, two threads (a larger share of the contended cores) beat one
    by a third; beside a process busy 4 ms in 10, two threads served 1.1-1.25x faster than one (measured).
    The readings barely tell these apart (this process's own time counts as free: on 2 cores a busy loop
    left 1.2-1.55, that process 1.65-1.76, guidellm's client at 32 streams 1.6-1.8), so while contended
    the governor tries the other count (the full one, or what is left rounded up from 0.7) now and then
    and keeps the faster, waiting twice as long after each try that loses. A try
    times replayed steps (`observe_step`) against the recent steps of the same shape at the count before
    it: each step's time over that shape's median, the try's median ratio deciding. Shapes may change
    from step to step (a server's steps mix decodes and prefill chunks); a step of a shape not timed
    before the try is not compared, and a try that finds nothing to compare in TRIAL_LIMIT steps ends
    lost. The cap is lifted again after RISE_AFTER readings in a row see the CPUs free.

    The cap lives in the C modules and each kernel reads it when it runs, so recorded step tapes follow
    it; torch's own thread count is left alone. One governor serves a process (`process_governor`).
    KILN_ADAPTIVE_THREADS=0 turns it off.

    Placement (`step`): while a step's kernels run on as many threads as this process has CPUs, the
    thread that steps is held on the first CPU and its OpenMP workers each on one of the others. Left to
    the scheduler, a process that wakes on one core (a client reading the streamed tokens) sends both
    kernel threads to the other core, where they take turns of about a millisecond, each spinning at the
    kernels' joins while the other runs, with a core idle beside them (seen with `perf sched`). Pinned, a
    mixed serving load beside a process busy 4 ms in 10 made 357 tok/s where it made 216-248 unpinned
    (268-279 with the cap at one thread), and 486 tok/s quiet where it made 452-457 (2-core EPYC, int16
    SmolLM2, 32 requests of 158 + 64 tokens). The stepping thread is pinned for the step only: between
    steps it keeps its own mask, so threads and processes it starts inherit the whole mask. Not pinned:
    a process that runs fewer kernel threads than its CPUs (ranks sharing a host, a CPU quota), a
    capped step (its one thread runs wherever the scheduler finds room), KILN_PIN_THREADS=0.
    """

    HEADROOM = 0.3       # contended while the CPUs left, plus this, fall short of all of them
    START_HEADROOM = 0.5  # contention starts at the CPUs left (the readings' mean) plus this, rounded down
    RISE_AFTER = 2
    DROP_AFTER = 2
    PROBE_STEPS = 6      # step times kept at the live count before a try, and steps a try compares
    TRIAL_LIMIT = 24     # steps a try may take to find PROBE_STEPS it can compare
    MAX_SHAPES = 64      # shapes timed at once (the least recent dropped)
    FIRST_HOLD = 1.0     # seconds before the first try of the other count; doubled after a losing try
    LONGEST_HOLD = 32.0
    KEPT_HOLD = 4.0      # at most this long before a contention that starts at the kept count tries the other
    WIN_MARGIN = 0.9     # the other count wins when its median step takes under 90% of the current one's

    def __init__(self, threads: int, interval: float = 0.25, proc: Path = PROC, clock=time.monotonic):
        self.threads = self.live = max(1, threads)
        self.interval, self.proc, self.clock = interval, proc, clock
        self.cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self.changes = 0
        self._rising = 0
        self._short: list[float] = []          # the readings in a row that fell short
        self.lower: int | None = None          # while contended: the count the CPUs left suggest
        self.kept: int | None = None           # the count the last try kept: where the next contention starts
        self._hold, self._try_at = self.FIRST_HOLD, 0.0
        self._timed: dict[object, list[float]] = {}   # shape -> its recent step times at the live count
        self._trial: list[float] | None = None        # a try's steps: time over the shape's median before it
        self._trial_timed: dict[object, list[float]] = {}  # the try's own step times, per shape
        self._trial_steps = self._before_trial = 0
        enabled = (self.threads > 1 and len(self.cpus) > 0
                   and os.environ.get("KILN_ADAPTIVE_THREADS", "1") != "0")
        self._last = read_cpu_times(self.cpus, proc) if enabled else None  # None: it never acts
        self._stepped = time.monotonic()  # the last step's end (its start for a caller that reports no end)
        self.pins = (self.threads > 1 and len(self.cpus) == self.threads
                     and os.environ.get("KILN_PIN_THREADS", "1") != "0")
        self.teams: dict[int, list[int]] = {}  # stepping thread's native id -> its team's native ids

    @property
    def active(self) -> bool:
        return self._last is not None

    def tick(self) -> None:
        last = self._last
        if last is None:
            return
        at, previous = time.monotonic(), self._stepped
        self._stepped = at
        if at - previous > self.interval:
            # No step for a whole interval since the last one ended: this process was idle, and what others ran
            # meanwhile (a benchmark's other engine, a client) says nothing about who holds the CPUs while it
            # steps. Read afresh. (The gap is counted from a step's end: steps longer than the interval, a
            # long prefill or any step on a crowded host, are not idle time.)
            self._last = read_cpu_times(self.cpus, self.proc) or last
            return
        if at - last.at < self.interval:
            return
        now = read_cpu_times(self.cpus, self.proc)
        if now is None:
            return
        self._last = now
        free = free_cpus(last, now, len(self.cpus))
        if free is not None:
            self.observe(free)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Around one step on the calling thread: tick, then the kernel threads' placement (see the class)."""
        self.tick()
        mask = self._pin()
        try:
            yield
        finally:
            self._stepped = time.monotonic()
            if mask is not None:
                os.sched_setaffinity(0, mask)

    def _pin(self) -> set[int] | None:
        """Holds the calling thread on the first CPU for a step (its workers pinned the first time); returns
        its own mask to restore, or None when the step is not pinned."""
        if not self.pins or self.live < self.threads:
            return None
        import torch

        if torch.get_num_threads() != self.threads:  # the kernels run on another count: the scheduler places them
            return None
        native = threading.get_native_id()
        if native not in self.teams:
            self.teams[native] = _ops.pin_team(self.cpus)
        mask = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {self.cpus[0]})
        return mask

    def observe(self, free: float) -> None:
        """Act on one reading: `free` CPUs were idle or this process's own."""
        target = max(1, min(self.threads, math.floor(free + self.HEADROOM)))
        if target >= self.threads:
            self._rising, self._short = self._rising + 1, []
            if self.lower is not None and self._rising >= self.RISE_AFTER:
                self._rising, self.lower = 0, None
                self._forget()
                self._set(self.threads, f"the CPUs are free again ({free:.1f} of {len(self.cpus)})")
            return
        self._rising, self._short = 0, (self._short + [free])[-self.DROP_AFTER:]
        if self.lower is None and len(self._short) >= self.DROP_AFTER:  # contention starts (see the class)
            self.lower = target
            self._forget()
            self._hold = self.FIRST_HOLD if self.kept is None else min(self._hold, self.KEPT_HOLD)
            self._try_at = self.clock() + self._hold
            left = sum(self._short) / len(self._short)
            self._set(self.kept or max(1, min(self.threads, math.floor(left + self.START_HEADROOM))),
                      f"other processes hold CPUs ({left:.1f} of {len(self.cpus)} free)")

    def _forget(self) -> None:
        self._timed, self._trial, self._trial_timed = {}, None, {}

    def observe_step(self, shape: object, seconds: float) -> None:
        """One step of `shape` took `seconds` at the live count: material for comparing the counts."""
        self._stepped = time.monotonic()
        if self.lower is None:  # not contended: nothing to compare
            return
        if self._trial is not None:
            self._trial_steps += 1
            before = self._timed.get(shape)
            if before:
                self._trial.append(seconds / median(before))
            _remember(self._trial_timed, shape, seconds, self.PROBE_STEPS, self.MAX_SHAPES)
            if len(self._trial) >= self.PROBE_STEPS:
                self._end_trial(median(self._trial) < self.WIN_MARGIN)
            elif self._trial_steps >= self.TRIAL_LIMIT:
                self._end_trial(won=False)
            return
        _remember(self._timed, shape, seconds, self.PROBE_STEPS, self.MAX_SHAPES)
        if self.clock() >= self._try_at and sum(map(len, self._timed.values())) >= self.PROBE_STEPS:
            self._trial, self._trial_timed, self._trial_steps, self._before_trial = [], {}, 0, self.live
            self._set(self.threads if self.live < self.threads else self.lower, f"trying it against {self.live}")

    def _end_trial(self, won: bool) -> None:
        result = (f"its steps took x{median(self._trial):.2f} the time of {self._before_trial}'s" if self._trial
                  else "no step of a shape timed before")
        if won:  # the try's times are the live count's now
            self._timed, self._hold = self._trial_timed, self.FIRST_HOLD
            log.info("kernel threads: %d kept (%s)", self.live, result)
        else:
            self._set(self._before_trial, f"the try of {self.live} lost ({result})")
            self._hold = min(2 * self._hold, self.LONGEST_HOLD)
        self._trial, self._trial_timed = None, {}
        self.kept = self.live
        self._try_at = self.clock() + self._hold

    def _set(self, count: int, why: str = "") -> None:
        if count != self.live:
            log.info("kernel threads at most %d of %d%s", count, self.threads, f": {why}" if why else "")
            self.changes += 1
        self.live = count
        _ops.set_thread_cap(0 if count >= self.threads else count)

    def close(self) -> None:
        """Lift the cap, give the pinned workers their whole mask back, and stop acting."""
        if self._last is not None:
            self._set(self.threads)
            self._last = self.lower = None
            self._forget()
        for team in self.teams.values():
            for tid in team[1:]:
                with contextlib.suppress(OSError):  # a worker that has exited
                    os.sched_setaffinity(tid, self.cpus)
        self.teams.clear()
        self.pins = False


def _remember(times: dict[object, list[float]], shape: object, seconds: float, keep: int, shapes: int) -> None:
    """Adds a step's time to its shape's recent times (`keep` of them; `shapes` shapes, the least recent dropped)."""
    recent = times.pop(shape, [])
    recent.append(seconds)
    times[shape] = recent[-keep:]
    if len(times) > shapes:
        del times[next(iter(times))]


_governor: ThreadGovernor | None = None


def process_governor() -> ThreadGovernor:
    """This process's governor, made on first use over the CPUs it may use (`usable_cpus`)."""
    global _governor
    if _governor is None:
        _governor = ThreadGovernor(usable_cpus())
    return _governor
