"""Kiln runtime: loads engine directories and serves them (never imports builder or passes)."""

__version__ = "0.1.0"

ENGINE_FORMAT = "kiln-engine"
RANK_FORMAT = "kiln-rank"
FORMAT_VERSION = 1  # bump when the runtime can no longer read older engines the same way
