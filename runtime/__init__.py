"""Kiln runtime: loads engine directories and serves them (never imports builder or passes)."""

import os

# OpenMP workers spin between parallel regions before they sleep. libgomp's default spin (300,000
# iterations) starved everything else on a busy host (the HTTP loop, other ranks): measured 5-18x
# slower steps on 2 shared cores. Never spinning (OMP_WAIT_POLICY=PASSIVE) makes every kernel of a
# decode step pay a thread wake-up: ~1.5x slower single-sequence decode. A tenth of the default
# spin covers the gaps between the kernels of one step (decode as fast as ACTIVE, measured) and
# sleeps soon after. The user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins. Takes effect only if
# set before torch is imported.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "30000")

__version__ = "0.2.0"
