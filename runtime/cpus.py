"""How many CPUs this process may really use: its affinity mask, capped by its cgroup's CPU quota.

OpenMP and torch count the CPUs in the affinity mask. A container limited by a CPU quota (cgroup v2
`cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`) sees every CPU of the host but gets only
quota / period of them; more kernel threads than that are throttled in turn, and every kernel of a
step waits for the last of them.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


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
