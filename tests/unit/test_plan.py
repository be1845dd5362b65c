"""Plans: the shipped plan files load, the device catalog is consistent, and each refusal names its key."""

from __future__ import annotations

from pathlib import Path

import pytest

from builder.planning.plan import (
    FP8_MIN_CC,
    Plan,
    PlanError,
    load_devices,
    load_plan,
    plan_from_dict,
)

PLANS = Path(__file__).resolve().parents[2] / "plans"
GPU_PLANS = ["a100-tp2-int4.toml", "l40s-fp8.toml", "rtx5090-int4.toml", "h100-tp4-fp8.toml"]


def test_plan_defaults_are_the_cpu_plan_file():
    assert load_plan(PLANS / "cpu.toml") == Plan() == load_plan()


@pytest.mark.parametrize("name", GPU_PLANS)
def test_gpu_plans_load(name):
    plan = load_plan(PLANS / name)
    device = load_devices()[plan.device]
    assert plan.target == "tensorrt" and device.kind == "gpu"
    assert plan.kv_cache.memory_fraction == 0.9
    assert plan.quant.activations in ("f16", "bf16")
    assert plan.to_dict() == plan.with_overrides().to_dict()  # round-trips as the manifest stores it


def test_gpu_plan_figures():
    h100 = load_plan(PLANS / "h100-tp4-fp8.toml")
    assert (h100.tp, h100.quant.method, h100.kv_cache.dtype, h100.quant.activations) == (4, "fp8", "fp8", "f16")
    a100 = load_plan(PLANS / "a100-tp2-int4.toml")
    assert (a100.tp, a100.quant.method, a100.quant.group_size) == (2, "int4", 32)
    rtx = load_plan(PLANS / "rtx5090-int4.toml")
    assert (rtx.limits.max_batch_size, rtx.limits.max_num_tokens, rtx.limits.max_seq_len) == (32, 1024, 4096)


def test_device_catalog():
    devices = load_devices()
    for name in ("nvidia-t4", "nvidia-a100-80gb", "nvidia-l4", "nvidia-l40s", "nvidia-rtx-5090",
                 "nvidia-h100-80gb", "nvidia-h200", "nvidia-b200"):
        assert devices[name].kind == "gpu", name
    for device in devices.values():
        if device.kind != "gpu":
            assert device.compute_capability is None and device.arch is None
            continue
        assert device.arch == "sm_" + device.compute_capability.replace(".", ""), device.name
        assert device.fp8 == (device.cc >= FP8_MIN_CC), device.name
    assert devices["nvidia-l40s"].memory_gib == 48 and devices["nvidia-l40s"].bandwidth_gbs == 864
    assert devices["nvidia-rtx-5090"].cc == (12, 0) and devices["nvidia-b200"].cc == (10, 0)


def gpu_plan(device="nvidia-h100-80gb", quant=None, kv_cache=None, target="tensorrt"):
    doc = {"target": target, "device": device, "quant": {"method": "int4", "activations": "f16", **(quant or {})}}
    if kv_cache:
        doc["kv_cache"] = kv_cache
    return plan_from_dict(doc, "test")


def refused(key: str, *fragments: str, **plan):
    with pytest.raises(PlanError) as info:
        gpu_plan(**plan)
    message = str(info.value)
    assert "\n" not in message and f"plan test: {key} " in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_fp8_weights_need_fp8_tensor_cores():
    message = refused("[quant] method", device="nvidia-a100-80gb", quant={"method": "fp8"})
    assert message.endswith("[quant] method fp8 needs FP8 tensor cores (compute capability 8.9+); "
                            "nvidia-a100-80gb is 8.0")
    assert gpu_plan(device="nvidia-l4", quant={"method": "fp8"}).quant.method == "fp8"


def test_an_fp8_kv_cache_needs_compute_capability_8_9():
    assert gpu_plan(device="nvidia-l4", kv_cache={"dtype": "fp8"}).kv_cache.dtype == "fp8"
    refused("[kv_cache] dtype", "fp8 needs FP8 tensor cores (compute capability 8.9+)",
            device="nvidia-a100-80gb", kv_cache={"dtype": "fp8"})


def test_integer_activations_are_cpu_paths():
    for activations in ("int8", "int16"):
        refused("[quant] activations", "cpu kernel path", 'activations = "f16"', quant={"activations": activations})


def test_unset_activations_follow_the_target():
    assert plan_from_dict({"target": "tensorrt", "device": "nvidia-l4"}, "test").quant.activations == "f16"
    assert plan_from_dict({"quant": {"method": "int4"}}, "test").quant.activations == "auto"
    written = plan_from_dict({"target": "tensorrt", "device": "nvidia-l4"}, "test").to_dict()
    assert plan_from_dict(written, "again").quant.activations == "f16"


def test_f16_and_bf16_activations_are_not_cpu_paths():
    for activations in ("f16", "bf16"):
        refused("[quant] activations", "the cpu target takes auto or f32 or int16 or int12 or int8",
                target="cpu", device="cpu", quant={"activations": activations})


def test_int8_kv_cache_is_cpu_only():
    refused("[kv_cache] dtype", "cpu-only", 'dtype = "f16"', kv_cache={"dtype": "int8"})
    assert plan_from_dict({"kv_cache": {"dtype": "int8"}}, "test").kv_cache.dtype == "int8"  # cpu keeps it


def test_the_gpu_targets_need_compute_capability_8():
    """Both run Kiln's Triton kernels (the tensorrt target's in its attention plugin), compiled for 8.0 and up;
    so a Turing card is refused by the target before bf16 (which it lacks too) comes up."""
    refused("device", "compute capability 7.5", "PagedAttention plugin", "8.0, 8.6", device="nvidia-t4")
    refused("device", "compute capability 7.5", device="nvidia-t4", quant={"activations": "bf16"})
    assert gpu_plan(device="nvidia-a10").quant.activations == "f16"
    assert gpu_plan(device="nvidia-a100-80gb", quant={"activations": "bf16"}).quant.activations == "bf16"


def test_unknown_activations_are_refused():
    refused("[quant] activations", "must be one of", quant={"activations": "f64"})


def test_tensorrt_takes_the_float_kv_caches_and_every_quant_method():
    for dtype in ("f16", "bf16", "f32"):
        assert gpu_plan(kv_cache={"dtype": dtype}).kv_cache.dtype == dtype
    for method in ("none", "source", "int8", "int4", "int4-awq", "fp8"):
        assert gpu_plan(quant={"method": method}).quant.method == method


def test_targets_keep_their_devices():
    refused("device", "GPU", target="cpu")
    refused("device", "needs a GPU", device="cpu")


def test_the_cuda_plan_and_what_the_cuda_target_takes():
    plan = load_plan(PLANS / "h100-cuda.toml")
    assert (plan.target, plan.device, plan.quant.method, plan.quant.group_size) == ("cuda", "nvidia-h100-80gb",
                                                                                    "int4", 64)
    assert plan.quant.activations == "bf16" and plan.kv_cache.dtype == "bf16"
    cuda = {"target": "cuda", "device": "nvidia-h100-80gb"}
    assert plan_from_dict(cuda, "test").quant.activations == "bf16"  # the target's first choice
    assert plan_from_dict(dict(cuda, kv_cache={"dtype": "fp8"}), "test").kv_cache.dtype == "fp8"
    for doc, key, fragment in (
            (dict(cuda, quant={"method": "int8"}), "[quant] method", "not available on the cuda target"),
            (dict(cuda, device="nvidia-t4"), "device", "the cuda target compiles for 8.0"),
            (dict(cuda, device="cpu"), "device", "needs a GPU device"),
            (dict(cuda, kv_cache={"dtype": "int8"}), "[kv_cache] dtype", "cpu-only KV cache"),
            (dict(cuda, quant={"activations": "int16"}), "[quant] activations", 'use activations = "bf16"')):
        with pytest.raises(PlanError) as info:
            plan_from_dict(doc, "test")
        assert f"plan test: {key} " in str(info.value) and fragment in str(info.value), str(info.value)


def test_auto_activations_choose_the_fastest_path_the_gate_allows(monkeypatch):
    from builder.measure.activation_choice import Speed, allowed, choose
    from runtime.ops import linear

    exact = {"greedy_agreement_pct": 100.0, "ppl_increase_pct": 0.0}
    # the default gate: f32's greedy agreement and perplexity within 0.01% of f32's
    figures = {"f32": None, "int16": exact, "int12": dict(exact, ppl_increase_pct=0.02),
               "int8": dict(exact, greedy_agreement_pct=97.9)}
    assert allowed(figures, None, None) == ["f32", "int16"]
    assert allowed(figures, 95, None) == ["f32", "int16", "int8"]
    assert allowed(figures, 95, 0.05) == ["f32", "int16", "int12", "int8"]
    f16 = {"greedy_agreement_pct": 97.9, "ppl_increase_pct": 0.004}  # f32 over an f16 cache, measured too
    assert allowed({"f32": f16, "int16": dict(f16, ppl_increase_pct=0.013), "int8": figures["int8"]},
                   None, None) == ["f32", "int16", "int8"]
    assert allowed({"f32": f16, "int16": dict(f16, greedy_agreement_pct=95.8)}, None, None) == ["f32"]
    assert allowed({"f32": f16}, 99, None) == ["f32"]  # none passing: the exact path
    speeds = {"f32": Speed(100, 1000), "int16": Speed(90, 900), "int8": Speed(180, 1500)}
    assert choose(speeds, ["f32", "int16", "int8"])[0] == "int8"
    chosen, why = choose(speeds, ["f32", "int16"])
    assert chosen == "f32" and "the gate refused int8" in why
    # a path must not buy decode speed with prefill: geometric mean of both
    assert choose({"f32": Speed(100, 1000), "int8": Speed(130, 600)}, ["f32", "int8"])[0] == "f32"
    # exact wins a near-tie: under MIN_GAIN a rounding path is timing noise
    chosen, why = choose({"f32": Speed(100, 1000), "int16": Speed(103, 1020)}, ["f32", "int16"])
    assert chosen == "f32" and "int16" in why and "x1.02" in why
    assert choose({"f32": Speed(100, 1000), "int16": Speed(100, 1400)}, ["f32", "int16"])[0] == "int16"
    # each coarser path must gain MIN_GAIN over the more precise one chosen before it (int12 is timed apart from
    # int16 only where AMX tiles run it: elsewhere it runs int16's instructions, and a gain is noise)
    ahead = {"f32": Speed(100, 1000), "int16": Speed(130, 1300), "int12": Speed(135, 1600)}
    monkeypatch.setattr(linear, "isa", lambda: "avx512")
    assert choose(ahead, ["f32", "int16", "int12"])[0] == "int16"
    monkeypatch.setattr(linear, "isa", lambda: "amx")
    near = {"f32": Speed(100, 1000), "int16": Speed(130, 1300), "int12": Speed(133, 1350)}
    chosen, why = choose(near, ["f32", "int16", "int12"])
    assert chosen == "int16" and "int12 x1.34 gained too little" in why
    ahead = {"f32": Speed(100, 1000), "int16": Speed(130, 1300), "int12": Speed(135, 1600)}
    assert choose(ahead, ["f32", "int16", "int12"])[0] == "int12"
