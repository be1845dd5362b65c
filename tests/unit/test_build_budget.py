"""A build's peak memory, priced from the model's shape before a weight is read (builder/planning/build_budget.py), and the
one-line refusal of a build the host cannot hold."""

from __future__ import annotations

import dataclasses

import pytest

from builder.planning import build_budget
from builder.planning.build_budget import check_host, price_build
from builder.errors import KilnError
from builder.planning.plan import load_plan
from builder.planning.shapes import load_shape
from runtime.format.engine_format import GIB


def plan(**quant):
    return load_plan().with_overrides("quant", **quant)


def test_the_price_follows_what_the_build_holds():
    small, large = load_shape("llama-3.1-8b"), load_shape("llama-3.1-70b")
    exact = price_build(small, plan(method="none").with_overrides("kv_cache", dtype="f32"))
    int4 = price_build(small, plan(method="int4"))
    awq = price_build(small, plan(method="int4-awq"))
    assert not exact.measured and exact.phase == "streaming the weights"
    assert exact.peak_bytes < 5 * GIB  # an exact build streams: a table and a layer, not the 32 GB model
    # measured a layer at a time, the quantized model too: a table, a layer and logits, not the 5 GB int4 model
    assert int4.measured and int4.peak_bytes < 5 * GIB
    assert exact.peak_bytes <= int4.peak_bytes < price_build(large, plan(method="int4")).peak_bytes
    narrow = dataclasses.replace(small, vocab_size=32000)  # a smaller table: two layers and logits set the peak
    assert price_build(narrow, plan(method="int4")).phase == "the accuracy measure, a layer at a time"
    assert awq.phase.startswith("AWQ/GPTQ calibration") and awq.peak_bytes > int4.peak_bytes
    tp8 = plan(method="int4").with_overrides(tp=8)
    assert price_build(narrow, tp8, rank=3).peak_bytes < price_build(narrow, tp8, rank=0).peak_bytes  # 0 measures
    assert price_build(small, tp8, rank=3).peak_bytes <= price_build(small, tp8, rank=0).peak_bytes


def test_awq_calibration_is_priced_by_hand_a_layer_at_a_time():
    """Llama-3.1-8B int4-awq: GPTQ's codes (two a byte, with a scale and a zero point per group of 32), three
    copies of a layer's float weights and two Hessians of the widest input (14336 x 14336 doubles); the 32 GB
    float model is not in it, and twice the layers add only their codes."""
    shape, awq = load_shape("llama-3.1-8b"), plan(method="int4-awq")
    layer = 4 * (4096 * (4096 + 2 * 1024 + 4096) + 3 * 4096 * 14336 + 2 * 4096)
    codes = 32 * (4096 * (4096 + 2 * 1024 + 4096) + 3 * 4096 * 14336) * (0.5 + 8 / 32)
    hessians = 2 * 8 * 14336 ** 2
    price = price_build(shape, awq)
    assert price.phase == "AWQ/GPTQ calibration, a layer at a time"
    assert price.peak_bytes == int(1.1 * (GIB + codes + 3 * layer + hessians))
    assert price.peak_bytes < 14 * GIB  # buildable on a 16 GB runner, where the whole float model is 32 GB
    deeper = price_build(dataclasses.replace(shape, num_layers=64), awq)
    assert deeper.peak_bytes == int(1.1 * (GIB + 2 * codes + 3 * layer + hessians))


def test_a_build_the_host_cannot_hold_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(build_budget, "available_memory", lambda: 2 * GIB)
    shape, tp2 = load_shape("llama-3.1-8b"), plan(method="int4").with_overrides(tp=2)
    with pytest.raises(KilnError) as info:
        check_host(shape, tp2, None)
    message = str(info.value)
    assert "\n" not in message and message.startswith("this build needs about ")
    assert "this host has 2.0 GiB available" in message and "--rank" in message and "--quant source" in message
    monkeypatch.setattr(build_budget, "available_memory", lambda: 5 * GIB)
    check_host(shape, plan(method="none").with_overrides("kv_cache", dtype="f32"), None)  # an exact build fits
    monkeypatch.setenv("KILN_BUILD_MEMORY_CHECK", "0")
    check_host(shape, tp2, None)  # the way to try anyway


def test_the_refusal_comes_before_any_weight_is_read(tiny_llama_dir, tmp_path, monkeypatch):
    from builder.build import build_engine
    from builder.sources.model import ModelSpec

    monkeypatch.setattr(build_budget, "available_memory", lambda: 1)

    def no_reading(self, name):
        raise AssertionError(f"read {name}")

    monkeypatch.setattr(ModelSpec, "load", no_reading)
    with pytest.raises(KilnError, match="this build needs about .* and this host has 0.0 GiB available"):
        build_engine(str(tiny_llama_dir), plan(method="int8"), tmp_path / "e", show_progress=False)
    assert not (tmp_path / "e").exists()


def test_the_time_price_follows_the_work_a_build_does():
    shape = load_shape("llama-3.1-8b")
    exact = price_build(shape, plan(method="none").with_overrides("kv_cache", dtype="f32"))
    int4, awq = price_build(shape, plan(method="int4")), price_build(shape, plan(method="int4-awq"))
    assert 0 < exact.seconds < int4.seconds < awq.seconds  # rounding, then measuring, then GPTQ add work
    tp8 = plan(method="int4").with_overrides(tp=8)
    assert price_build(shape, tp8, rank=3).seconds < price_build(shape, tp8, rank=0).seconds < int4.seconds + 1
    assert price_build(shape, tp8, rank=3).seconds > exact.seconds / 8  # a rank job rounds its stage's weights whole
    assert price_build(load_shape("llama-3.1-70b"), plan(method="int4")).seconds > 8 * int4.seconds
    assert [build_budget.duration(s) for s in (3, 61, 300, 7199)] == ["about 5 s", "about 60 s", "about 5 min",
                                                                      "about 2.0 h"]
