"""Kiln's cache: what builds and engines measure once per host and keep (reference answers, activation paths'
figures, a host's timings) and engines fetched from a URL (runtime/backends/fetch.py), in $KILN_CACHE_DIR, else
$XDG_CACHE_HOME/kiln or ~/.cache/kiln."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("KILN_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                / "kiln")


def cache_path(kind: str, key: dict) -> Path:
    """The file that keeps what `key` decides, in the cache's folder `kind` (a digest of the key names it)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return cache_root() / kind / f"{digest[:32]}.json"
