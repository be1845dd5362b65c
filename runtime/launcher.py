"""Open an engine for serving: one rank in this process, or (multi-rank engines) one process per rank."""

from __future__ import annotations

import contextlib
from pathlib import Path

from runtime.engine import EngineOptions, LLMEngine
from runtime.engine_dir import EngineError, open_engine


@contextlib.contextmanager
def open_llm_engine(path: str | Path, options: EngineOptions = EngineOptions()):
    engine_dir = open_engine(path, check_hashes=options.check_hashes)
    if engine_dir.world_size != 1:
        raise EngineError(f"{path}: {engine_dir.world_size}-rank engines need the multi-rank launcher")
    yield LLMEngine(engine_dir, options)
