"""The CPU count a process may use (affinity, capped by a cgroup v1 or v2 CPU quota), and the thread
governor that follows the CPUs other processes leave it."""

import logging
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from runtime._native import _ops
from runtime.backends.cpu.cpus import (
    CpuTimes,
    ThreadGovernor,
    cgroup_cpu_limit,
    free_cpus,
    process_governor,
    read_cpu_times,
    usable_cpus,
)


def test_cgroup_v2_quota_and_no_quota(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(tmp_path) is None


def test_cgroup_v1_quota_and_no_quota(tmp_path):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    assert cgroup_cpu_limit(tmp_path) == 0.5
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_limit(tmp_path) is None


def test_usable_cpus_is_the_affinity_capped_by_the_quota(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    assert usable_cpus(tmp_path) == affinity  # no cgroup files: no quota
    (tmp_path / "cpu.max").write_text("50000 100000\n")
    assert usable_cpus(tmp_path) == 1  # half a CPU still runs one thread
    (tmp_path / "cpu.max").write_text(f"{(affinity + 1) * 100000} 100000\n")
    assert usable_cpus(tmp_path) == affinity
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert usable_cpus(tmp_path) == min(affinity, math.ceil(2.5))


# ------------------------------------------------------------------------------ the thread governor

def test_read_cpu_times_sums_the_affinity_cpus_and_this_process(tmp_path):
    (tmp_path / "self").mkdir()
    (tmp_path / "stat").write_text(
        "cpu  9 9 9 9 9 9 9 9 0 0\n"
        "cpu0 10 1 5 100 4 1 1 2 7 0\n"      # idle+iowait 104, all 124 (guest 7 is inside user)
        "cpu1 20 0 10 50 0 0 0 0 0 0\n"      # idle 50, all 80
        "cpu2 1000 0 0 0 0 0 0 0 0 0\n"      # not ours
        "intr 12345\n")
    (tmp_path / "self" / "stat").write_text("4242 (a (weird) name) R 1 2 3 4 5 6 7 8 9 10 33 11 0 0 20 0\n")
    times = read_cpu_times([0, 1], tmp_path)
    assert (times.idle, times.total, times.own) == (154, 204, 44)
    assert read_cpu_times([0], tmp_path / "missing") is None


def test_free_cpus_counts_idle_and_own_time_per_cpu_of_wall_time():
    before = CpuTimes(0.0, idle=0, total=0, own=0)
    # 2 CPUs for 100 ticks each: 30 idle, this process 120, someone else 50
    assert free_cpus(before, CpuTimes(1.0, idle=30, total=200, own=120), 2) == 1.5
    assert free_cpus(before, before, 2) is None


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def contended_governor(clock: Clock) -> ThreadGovernor:
    governor = ThreadGovernor(2, clock=clock)
    if not governor.active:
        pytest.skip("no /proc to read here")
    return governor


def steps(governor: ThreadGovernor, seconds: float, count: int = ThreadGovernor.PROBE_STEPS, shape=(1, 1, 1)):
    for _ in range(count):
        governor.observe_step(shape, seconds)


def test_the_governor_drops_after_two_short_readings_and_lifts_after_two_free_ones():
    governor = contended_governor(Clock())
    threads = torch.get_num_threads()
    try:
        governor.observe(1.95)
        assert governor.live == 2 and governor.lower is None
        governor.observe(1.33)  # another process holds one of the two CPUs, or a client had a burst
        assert governor.live == 2 and governor.lower is None  # one reading is not enough
        governor.observe(1.33)
        assert governor.live == 1 and governor.lower == 1 and _ops.thread_cap() == 1
        assert _ops.live_threads(2) == 1 and _ops.live_threads(1) == 1
        assert torch.get_num_threads() == threads  # torch's own count is not the governor's to change
        governor.observe(1.9)
        assert governor.live == 1  # one free reading is not enough
        governor.observe(1.2)
        governor.observe(1.9)
        assert governor.live == 1  # the readings in a row start again
        governor.observe(2.0)
        assert governor.live == 2 and governor.lower is None and _ops.thread_cap() == 0
        governor.observe(0.1)
        governor.observe(1.95)
        governor.observe(0.1)
        assert governor.live == 2  # short readings apart drop nothing
        governor.observe(0.1)
        assert governor.live == 1  # never below one thread
        assert governor.changes == 3
    finally:
        governor.close()
    assert _ops.thread_cap() == 0 and _ops.live_threads(2) == 2


class FakeProc:
    """A /proc whose counters advance by hand: each `advance` is 100 ticks of each CPU this process may
    use, `free` CPUs' worth of them this process's own (the rest another process's)."""

    def __init__(self, root):
        self.root, self.total, self.own = root, 0, 0
        self.cpus = sorted(os.sched_getaffinity(0))
        (root / "self").mkdir()
        self.advance(2.0)

    def advance(self, free: float) -> None:
        self.total += 100  # never idle
        self.own += int(100 * free)
        (self.root / "stat").write_text("".join(f"cpu{c} {self.total} 0 0 0 0 0 0 0 0 0\n" for c in self.cpus))
        (self.root / "self" / "stat").write_text(f"1 (python) R {' '.join(['0'] * 10)} {self.own} 0 0 0 20 0\n")


def test_steps_longer_than_the_interval_are_not_idle_time(tmp_path, monkeypatch):
    """A gap from one step's end to the next longer than the interval is idle time (read afresh); a step
    longer than the interval is not: beside a busy process a crowded host's steps may take that long, and
    the governor must still see the contention (a tick's gap counted from the last tick never did)."""
    monkeypatch.setenv("KILN_ADAPTIVE_THREADS", "1")  # the /proc is this test's own: nothing to skip for
    proc = FakeProc(tmp_path)
    governor = ThreadGovernor(2, interval=0.05, proc=proc.root)
    assert governor.active
    try:
        for _ in range(4):  # idle gaps: others' work then says nothing
            governor.tick()
            governor.observe_step((8, 1, 1), 0.001)
            proc.advance(1.0)
            time.sleep(0.08)
        assert governor.live == 2 and governor.lower is None
        for _ in range(4):  # steps of 80 ms, one CPU of two held by another process throughout
            governor.tick()
            time.sleep(0.08)
            proc.advance(1.0)
            governor.observe_step((8, 1, 1), 0.08)
        assert governor.live == 1 and governor.lower == 1
    finally:
        governor.close()


def contend(governor: ThreadGovernor, free: float) -> None:
    """Readings enough in a row to start contention."""
    for _ in range(ThreadGovernor.DROP_AFTER):
        governor.observe(free)


def test_while_contended_the_governor_keeps_the_count_whose_steps_run_faster(caplog):
    caplog.set_level(logging.INFO, logger="runtime.backends.cpu.cpus")
    clock = Clock()
    governor = contended_governor(clock)
    try:
        contend(governor, 1.0)
        assert governor.live == 1
        steps(governor, 0.020, 1)  # a new shape: its first step only sets the shape
        steps(governor, 0.020)
        assert governor.live == 1  # not before the hold is over
        clock.now += ThreadGovernor.FIRST_HOLD
        steps(governor, 0.020, 1)  # enough steps timed at one thread: try two
        assert governor.live == 2 and _ops.thread_cap() == 0
        steps(governor, 0.080)  # two threads lose (one busy core of two)
        assert governor.live == 1 and _ops.thread_cap() == 1
        clock.now += ThreadGovernor.FIRST_HOLD  # the next try waits twice as long
        steps(governor, 0.030)  # every core busy now: one thread got slower
        assert governor.live == 1
        clock.now += ThreadGovernor.FIRST_HOLD
        steps(governor, 0.030, 1)
        assert governor.live == 2
        steps(governor, 0.020)  # two threads win and stay, while readings still show contention
        governor.observe(1.0)
        assert governor.live == 2 and _ops.thread_cap() == 0
        # a try over steps of shapes not timed before it compares nothing: it ends, and the count before it stays
        clock.now += ThreadGovernor.FIRST_HOLD
        steps(governor, 0.020, 1)
        assert governor.live == 1
        steps(governor, 0.050, ThreadGovernor.TRIAL_LIMIT - 1, shape=(8, 8, 8))
        assert governor.live == 1
        steps(governor, 0.050, 1, shape=(8, 8, 8))
        assert governor.live == 2
    finally:
        governor.close()
    # each change says why, so a server's log tells contention, tries and their outcomes apart
    assert [r.getMessage() for r in caplog.records if r.name == "runtime.backends.cpu.cpus"][:7] == [
        "kernel threads at most 1 of 2: other processes hold CPUs (1.0 of 2 free)",
        "kernel threads at most 2 of 2: trying it against 1",
        "kernel threads at most 1 of 2: the try of 2 lost (its steps took x4.00 the time of 1's)",
        "kernel threads at most 2 of 2: trying it against 1",
        "kernel threads: 2 kept (its steps took x0.67 the time of 1's)",
        "kernel threads at most 1 of 2: trying it against 2",
        "kernel threads at most 2 of 2: the try of 1 lost (no step of a shape timed before)"]


def test_a_try_compares_each_step_with_steps_of_its_own_shape():
    """A server's steps change shape from one to the next (decodes, prefill chunks): the counts are still
    compared, each step against the recent steps of its shape, whatever their mix."""
    clock = Clock()
    governor = contended_governor(clock)
    short, long = (32, 32, 32), (96, 33, 32)

    def mixed(seconds_short: float, seconds_long: float, count: int) -> None:
        for i in range(count):
            governor.observe_step(long if i % 3 else short, seconds_long if i % 3 else seconds_short)

    try:
        contend(governor, 1.2)  # another process holds most of a core
        assert governor.live == 1
        mixed(0.020, 0.060, 9)
        clock.now += ThreadGovernor.FIRST_HOLD
        mixed(0.020, 0.060, 1)
        assert governor.live == 2  # the try starts though no two steps in a row had one shape
        mixed(0.016, 0.048, 6)  # both shapes 0.8x: two threads win, though a long step is slower than a short one
        assert governor.live == 2
        clock.now += ThreadGovernor.FIRST_HOLD
        mixed(0.016, 0.048, 1)
        assert governor.live == 1  # the next try, of one thread
        mixed(0.020, 0.060, 6)  # 1.25x: it loses
        assert governor.live == 2
        clock.now += 2 * ThreadGovernor.FIRST_HOLD
        mixed(0.016, 0.048, 1)
        assert governor.live == 1
        mixed(0.008, 0.024, 6)  # now one thread is twice as fast (the other core got busy): it wins
        assert governor.live == 1
    finally:
        governor.close()


def test_contention_that_comes_back_starts_at_the_count_the_last_try_kept():
    """A client busy now and then starts contention again and again: once a try has kept two threads, the
    next contention keeps them and tries one later, instead of dropping to one at once."""
    clock = Clock()
    governor = contended_governor(clock)
    try:
        contend(governor, 1.2)
        assert governor.live == 1 and governor.kept is None  # the first contention: what the CPUs left
        steps(governor, 0.030)
        clock.now += ThreadGovernor.FIRST_HOLD
        steps(governor, 0.030, 1)
        steps(governor, 0.020)  # two threads win
        assert governor.live == 2 and governor.kept == 2
        governor.observe(2.0)
        governor.observe(2.0)  # the CPUs are free again: contention over
        assert governor.lower is None and governor.live == 2
        contend(governor, 1.2)  # it comes back: two threads stay
        assert governor.lower == 1 and governor.live == 2
        steps(governor, 0.020)
        assert governor.live == 2
        clock.now += ThreadGovernor.FIRST_HOLD
        steps(governor, 0.020, 1)
        assert governor.live == 1  # then one is tried
        steps(governor, 0.010)  # and kept: the other core is busy now
        assert governor.live == 1 and governor.kept == 1
    finally:
        governor.close()


def test_a_client_busy_now_and_then_starts_contention_at_two_threads_and_one_is_tried():
    """Readings of 1.6-1.8 free CPUs on two (a client's share) are contention, but not enough to drop at
    once: two threads stay until a try of one says otherwise."""
    clock = Clock()
    governor = contended_governor(clock)
    try:
        contend(governor, 1.65)
        assert governor.lower == 1 and governor.live == 2 and _ops.thread_cap() == 0
        steps(governor, 0.020)
        clock.now += ThreadGovernor.FIRST_HOLD
        steps(governor, 0.020, 1)
        assert governor.live == 1  # the try
        steps(governor, 0.025)  # one thread is slower: two stay
        assert governor.live == 2 and governor.kept == 2
        governor.observe(1.65)
        governor.observe(1.3)
        assert governor.lower == 1 and governor.live == 2  # readings of a core held busy: still two ...
        clock.now += 2 * ThreadGovernor.FIRST_HOLD
        steps(governor, 0.060, 1)
        steps(governor, 0.015)  # ... until a try of one thread wins
        assert governor.live == 1 and governor.kept == 1
    finally:
        governor.close()


def test_one_governor_serves_the_process():
    assert process_governor() is process_governor()
    assert process_governor().threads == usable_cpus()


def test_a_governor_of_one_thread_or_turned_off_never_acts(monkeypatch):
    assert not ThreadGovernor(1).active
    monkeypatch.setenv("KILN_ADAPTIVE_THREADS", "0")
    assert not ThreadGovernor(4).active


BUSY_CPU_ROUND_TRIP = """
import os, subprocess, sys, time
import torch
from runtime.backends.cpu.cpus import ThreadGovernor
from runtime.ops import linear
from runtime.weights import int4

first, second = sorted(os.sched_getaffinity(0))[:2]
os.sched_setaffinity(0, {first, second})
n, k = 1536, 576
q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
scales = torch.full((n, k // 32), 0.01)
bound = linear.bind(int4.FORMAT, int4.pack(q, scales, scales * 8, 32), n, k, 32)
x = torch.randn(8, k)
governor = ThreadGovernor(2, interval=0.1)
assert governor.active, "the governor is off (KILN_ADAPTIVE_THREADS=0?)"
busy = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{second}}})\\nwhile True: pass"])


def run_until(live, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        governor.tick()
        started = time.perf_counter()
        bound(x, num_threads=2)
        governor.observe_step((8, 1, 1), time.perf_counter() - started)  # as the executor times a step
        if governor.live == live:
            return True
    return False


try:
    assert run_until(1, 5.0), "the governor kept 2 threads beside a busy CPU"
    busy.kill()
    busy.wait()
    assert run_until(2, 5.0), "the governor did not come back to 2 threads once the CPU was free"
finally:
    busy.kill()
    governor.close()
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to keep one busy")
def test_a_busy_process_on_one_of_two_cpus_takes_the_kernels_to_one_thread_and_back():
    """Real processes: kernels on 2 threads while a busy loop spins on the second CPU. In a process of its
    own: in the test session's process, an OpenMP team that an earlier test's steps pinned (a worker held on
    the second CPU, spinning between these back-to-back calls) shares that CPU with the busy loop, and its
    spinning counts as this process's time (seen: readings of 1.7-2.0 CPUs free, the busy loop getting half
    a CPU, after the replica tests)."""
    env = {**os.environ, "KILN_ADAPTIVE_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", BUSY_CPU_ROUND_TRIP], capture_output=True, text=True, timeout=60,
                          env=env, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]


def _step_on_a_new_thread(governor: ThreadGovernor) -> dict:
    """One governor step on a thread of its own (its OpenMP workers go with it): the affinities seen."""
    seen = {}

    def run():
        seen["before"] = os.sched_getaffinity(0)
        with governor.step():
            _ops.argmax_rows(torch.empty(1, dtype=torch.int64).numpy(), torch.randn(1, 1 << 16).numpy(),
                             1 << 16, 0)  # a kernel on the team: the workers pin_team pinned run it
            seen["during"] = os.sched_getaffinity(0)
            team = governor.teams.get(threading.get_native_id(), [])
            seen["workers"] = [os.sched_getaffinity(tid) for tid in team[1:]]
            seen["team"] = team
        seen["after"] = os.sched_getaffinity(0)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return seen


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to place two threads")
def test_a_step_holds_each_kernel_thread_on_a_cpu_of_its_own_and_only_for_the_step(monkeypatch):
    cpus = sorted(os.sched_getaffinity(0))
    threads_before = torch.get_num_threads()
    torch.set_num_threads(len(cpus))
    governor = ThreadGovernor(len(cpus))
    try:
        assert governor.pins
        seen = _step_on_a_new_thread(governor)
        assert seen["during"] == {cpus[0]}
        assert seen["after"] == seen["before"] == set(cpus)  # between steps the thread keeps its own mask
        assert len(seen["team"]) == len(cpus)
        assert seen["workers"] == [{cpu} for cpu in cpus[1:]]

        governor.close()  # the workers get the whole mask back
        team = seen["team"]
        assert all(os.sched_getaffinity(tid) == set(cpus) for tid in team[1:] if os.path.exists(f"/proc/self/task/{tid}"))
        assert not governor.pins

        capped = ThreadGovernor(len(cpus))
        capped._set(1)  # a capped step runs on one thread, wherever the scheduler finds room
        assert _step_on_a_new_thread(capped)["during"] == set(cpus)
        capped.close()

        monkeypatch.setenv("KILN_PIN_THREADS", "0")
        assert not ThreadGovernor(len(cpus)).pins
        monkeypatch.delenv("KILN_PIN_THREADS")
        torch.set_num_threads(1)  # kernels on fewer threads than the CPUs (ranks sharing a host): not placed
        assert _step_on_a_new_thread(ThreadGovernor(len(cpus)))["during"] == set(cpus)
        assert not ThreadGovernor(len(cpus) + 1).pins  # a quota below the mask
    finally:
        governor.close()
        torch.set_num_threads(threads_before)


def test_what_others_ran_while_this_process_was_idle_is_not_contention(tmp_path):
    """A reading that spans a gap between steps (a benchmark's other engine ran, then went quiet) is dropped; the
    same share of the CPUs taken while this process steps caps the threads."""
    cpus = sorted(os.sched_getaffinity(0))
    (tmp_path / "self").mkdir()
    ticks = {"other": 0, "own": 0, "idle": 0}

    def write():
        user = (ticks["other"] + ticks["own"]) // len(cpus)  # this process's time is CPU time too
        lines = [f"cpu{c} {user} 0 0 {ticks['idle'] // len(cpus)} 0 0 0 0 0 0" for c in cpus]
        (tmp_path / "stat").write_text("cpu  0 0 0 0 0 0 0 0 0 0\n" + "\n".join(lines) + "\n")
        (tmp_path / "self" / "stat").write_text(f"1 (python) R 1 1 1 1 1 1 1 1 1 1 {ticks['own']} 0 0 0 20 0\n")

    def busy_others(share: float, seconds: float = 0.12):
        """Tick every 10 ms while the CPUs are this process's, or `share` of them someone else's."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            ticks["other"] += round(share * 2 * len(cpus))
            ticks["own"] += round((1 - share) * 2 * len(cpus))
            write()
            governor.tick()
            time.sleep(0.01)

    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs: one thread has nothing to cap")
    write()
    governor = ThreadGovernor(len(cpus), interval=0.05, proc=tmp_path)
    try:
        busy_others(0.0)
        assert governor.live == len(cpus)
        time.sleep(0.1)  # idle: someone else takes every CPU meanwhile, then stops
        ticks["other"] += 1000
        write()
        busy_others(0.0)
        assert governor.live == len(cpus) and governor.changes == 0
        busy_others(0.5)  # the same while stepping: capped
        assert governor.live < len(cpus)
    finally:
        governor.close()
