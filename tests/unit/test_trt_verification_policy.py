"""What a tensorrt build's ONNX verification accepts (builder/targets/tensorrt/build.py's judge): exact paths are
held to 1e-3, half-precision rounding to a share of the largest logit, and fp8 rounding, which cascades, to a
wider share."""

from __future__ import annotations

import pytest

from builder.targets.tensorrt.build import judge
from builder.targets.tensorrt.verify_onnx import Verification


def seen(diff: float, top1: float = 1.0) -> Verification:
    return Verification(max_abs_logit_diff=diff, max_abs_logit=30.0, top1_agreement=top1)


def test_exact_paths_are_held_to_1e_3():
    assert judge(seen(9e-4), "f32", "f32") == (pytest.approx(1e-3), None)
    limit, problem = judge(seen(2e-3), "f32", "f32")
    assert "differ from the cpu engine's by 0.002 (limit 0.001: f32 activations, f32 KV cache)" in problem


def test_half_precision_is_held_to_five_percent_of_the_largest_logit():
    assert judge(seen(1.4), "f16", "f16")[1] is None
    assert "limit 1.5" in judge(seen(1.6), "f16", "f16")[1]


@pytest.mark.parametrize("kv,fp8_activations", [("fp8", False), ("f16", True), ("fp8", True)])
def test_fp8_rounding_is_held_to_a_quarter_of_it(kv, fp8_activations):
    limit, problem = judge(seen(6.12, top1=0.7), "f16", kv, fp8_activations)  # SmolLM2's fp8 plan, measured
    assert limit == pytest.approx(7.5) and problem is None
    assert "limit 7.5" in judge(seen(7.6), "f16", kv, fp8_activations)[1]
    assert "limit 0.001" in judge(seen(0.54), "f32", "f32")[1]  # the same difference fails an exact path


def test_a_given_tolerance_replaces_the_plans():
    assert judge(seen(0.5), "f32", "f32", limit=1.0) == (1.0, None)
