"""Kiln runtime: loads engine directories and serves them (never imports builder or passes)."""

import os

# OpenMP workers that spin between parallel regions starve everything else on a busy host (the
# HTTP loop, other ranks, the next kernel): measured 5-18x slower steps on 2 shared cores. Sleep
# instead, unless the user chose otherwise. Takes effect only if set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"

ENGINE_FORMAT = "kiln-engine"
RANK_FORMAT = "kiln-rank"
FORMAT_VERSION = 1  # bump when the runtime can no longer read older engines the same way
