"""Kiln's cache: what builds and engines measure once per host and keep (reference answers, activation paths'
figures, a host's timings), in $KILN_CACHE_DIR, else $XDG_CACHE_HOME/kiln or ~/.cache/kiln."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def cache_path(kind: str, key: dict) -> Path:
    """The file that keeps what `key` decides, in the cache's folder `kind` (a digest of the key names it)."""
    root = os.environ.get("KILN_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kiln"
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return Path(root) / kind / f"{digest[:32]}.json"
