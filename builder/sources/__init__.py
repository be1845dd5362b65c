"""Model sources: a preset name, a Hugging Face model directory or a .gguf file, each read into a ModelSpec
(builder/sources/model.py) that tracing and the passes take."""

from __future__ import annotations

from pathlib import Path

from builder.errors import KilnError
from builder.sources import gguf_source, hf, presets
from builder.sources.model import ModelSpec


def load_model(source: str) -> ModelSpec:
    """Open a model source: a preset name, a Hugging Face model directory or a .gguf file."""
    preset_path = presets.resolve_preset(source)
    if preset_path is not None:
        return gguf_source.load_gguf(preset_path, name=source)
    path = Path(source).expanduser()
    if not path.exists():
        raise KilnError(f"model: {source}: no such file or directory (expected a Hugging Face model directory, "
                        f"a .gguf file or a preset: {', '.join(sorted(presets.PRESETS))})")
    path = path.resolve()
    if path.is_dir():
        return hf.load_hf_dir(path)
    return gguf_source.load_gguf(path)
