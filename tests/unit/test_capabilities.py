"""Targets and backends by their capabilities: outside the two registries (builder/targets/__init__.py,
runtime/backends/__init__.py) no module compares a target's or a backend's name; each asks the target or backend
module for what it can do (WRITES_ONNX, WINDOWED_POOLS, DRAFTS, ACTIVATION_PATHS, ...)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from builder.targets import TARGETS, target
from runtime.backends import BACKENDS, backend

ROOT = Path(__file__).resolve().parents[2]
REGISTRIES = {ROOT / "builder/targets/__init__.py", ROOT / "runtime/backends/__init__.py"}
NAME = r"""["'](?:cpu|cuda|tensorrt|onnxruntime)["']"""
SUBJECT = r"""\b\w*(?:target|backend)\w*(?:["']\])?(?:\.name|\[["']name["']\])?"""
COMPARISON = re.compile(rf"{SUBJECT}\s*(?:==|!=|\bnot in\b|\bin\b)\s*\(?\s*{NAME}|{NAME}\s*(?:==|!=)\s*[\w.]*(?:target|backend)")


def comparisons(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if COMPARISON.search(line) and not line.lstrip().startswith("#")]


def test_no_module_outside_the_registries_compares_target_or_backend_names():
    found = []
    for package in ("builder", "passes", "runtime"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path not in REGISTRIES:
                found += [f"{path.relative_to(ROOT)}: {line}" for line in comparisons(path.read_text())]
    assert not found, "\n".join(found)


def test_the_grep_finds_a_comparison():
    assert comparisons('if plan.target == "cpu":\n') and comparisons("if manifest['target']['name'] != 'tensorrt':")
    assert comparisons('ok = backend in ("cuda", "tensorrt")') and comparisons('if "cuda" == self.backend_name:')
    assert not comparisons('if device.type == "cuda":\n') and not comparisons('if flavour == "tensorrt":')


TARGET_CAPABILITIES = ("DEVICE_KIND", "ACTIVATIONS", "KV_DTYPES", "QUANT_METHODS", "RANKS_ALONE", "WRITES_ONNX",
                       "WINDOWED_POOLS", "KERNELS_WIDEN", "FP8_ACTIVATION_SCALES", "LIVE_ACTIVATIONS")
BACKEND_CAPABILITIES = ("TARGETS", "WINDOWED_POOLS", "DEFAULT_KV_GIB", "GPU", "DRAFTS", "ACTIVATION_PATHS")


@pytest.mark.parametrize("name", TARGETS)
def test_every_target_declares_every_capability(name):
    module = target(name)
    assert [c for c in TARGET_CAPABILITIES if not hasattr(module, c)] == []


@pytest.mark.parametrize("name", BACKENDS)
def test_every_backend_declares_every_capability(name):
    module = backend(name)
    assert [c for c in BACKEND_CAPABILITIES if not hasattr(module, c)] == []
