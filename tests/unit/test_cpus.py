"""The CPU count a process may use: affinity, capped by a cgroup v1 or v2 CPU quota."""

import math
import os

from runtime.cpus import cgroup_cpu_limit, usable_cpus


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
