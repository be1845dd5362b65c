"""Quantization tensor math (runtime/weights, builder/quant) and the packed layouts through the executor's kernels.

Error bounds follow from the formats: round-to-nearest moves each weight by at most half a step,
the step being scale (int8: max|w|/127 per channel; int4: (max - min)/15 per group); e4m3 keeps 3
mantissa bits, so a normal value moves by at most 2^-4 of itself and a subnormal by 2^-10 * scale.
"""

import pytest
import torch

from builder.graph.ir import Graph, Node, Value, verify
from builder.quant.packing import pack_graph
from runtime.backends.activations import with_activations
from builder.planning.plan import load_plan
from builder.quant.awq import awq_clip, awq_search
from builder.quant.gptq import fit_int4_grid, gptq_int4
from passes.context import PassContext
from passes.quantize_fp8 import quantize_fp8
from passes.quantize_int4 import quantize_int4
from passes.quantize_int8 import quantize_int8
from runtime.ops import linear
from runtime.weights import fp8, int4, int8
from runtime.weights.format import expand_scales, relative_error

F32_SLACK = 1e-6  # relative float32 rounding in the dequantized weights


def weights(n: int, k: int, seed: int, outliers: bool) -> torch.Tensor:
    """Gaussian weights; with `outliers`, two input channels 50x larger and one all-zero row."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    if outliers:
        w[:, 3] *= 50
        w[:, k - 5] *= -50
        w[1] = 0
    return w


CASES = [(64, 256, False), (48, 384, True)]


@pytest.mark.parametrize("n, k, outliers", CASES)
@pytest.mark.parametrize("group_size", [None, 32])
def test_int8_error_is_at_most_half_a_step(n, k, outliers, group_size):
    w = weights(n, k, 0, outliers)
    q, scales, zeros, error = int8.quantize(w, group_size)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127 and zeros is None
    assert scales.shape == ((n,) if group_size is None else (n, k // group_size))
    approx = int8.dequantize(q, scales)
    step = expand_scales(scales, k).float()
    assert bool(((w - approx).abs() <= step / 2 + F32_SLACK * w.abs()).all())
    assert error == pytest.approx(relative_error(w, approx)) and error <= (step / 2).norm() / w.norm()
    if outliers:
        assert bool((approx[1] == 0).all())


@pytest.mark.parametrize("n, k, outliers", CASES)
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_error_is_at_most_half_a_step(n, k, outliers, group_size):
    w = weights(n, k, 1, outliers)
    q, scales, zeros, error = int4.quantize(w, group_size)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    assert scales.shape == zeros.shape == (n, k // group_size)
    approx = int4.dequantize(q, scales, zeros)
    step = expand_scales(scales, k).float()
    assert bool(((w - approx).abs() <= step / 2 + F32_SLACK * (w.abs() + step)).all())
    assert error == pytest.approx(relative_error(w, approx)) and 0 < error <= (step / 2).norm() / w.norm()
    if outliers:
        assert bool((approx[1] == 0).all())


@pytest.mark.parametrize("n, k, outliers", CASES)
@pytest.mark.parametrize("per_channel", [True, False])
def test_fp8_error_is_within_three_mantissa_bits(n, k, outliers, per_channel):
    w = weights(n, k, 2, outliers)
    q, scales, _, error = fp8.quantize(w, per_channel)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == ((n,) if per_channel else (1,))
    assert not bool(q.float().isnan().any()) and float(q.float().abs().max()) <= 448
    approx = fp8.dequantize(q, scales)
    scale = scales.reshape(-1, 1).expand(n, 1)
    bound = torch.maximum(w.abs() * 2.0 ** -4, scale * 2.0 ** -10) * (1 + F32_SLACK)
    assert bool(((w - approx).abs() <= bound).all())
    assert error == pytest.approx(relative_error(w, approx)) and error <= bound.norm() / w.norm()


def test_int4_error_exceeds_fp8_exceeds_int8_on_gaussian_weights():
    w = weights(96, 256, 3, False)
    errors = [int4.quantize(w, 32).error, fp8.quantize(w).error, int8.quantize(w).error]
    assert errors == sorted(errors, reverse=True)


def test_awq_search_beats_round_to_nearest_on_outlier_activations():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(256, 128, generator=g)
    x[:, [7, 50, 91]] *= 40  # a few activation channels carry most of the signal
    w = [torch.randn(64, 128, generator=g) * 0.05, torch.randn(32, 128, generator=g) * 0.05]
    found = awq_search(x, w, lambda t: int4.fake_quantize(t, 32))
    assert found.alpha > 0 and found.error < 0.7 * found.error_rtn
    assert found.scales.shape == (128,) and bool((found.scales[[7, 50, 91]] > found.scales.median()).all())
    tied = awq_search(x, w, lambda t: int4.fake_quantize(t, 32), channel_map=torch.arange(128) % 64)
    assert tied.scales.shape == (64,) and tied.error <= tied.error_rtn


def test_awq_clip_never_raises_a_group_error_and_helps_on_the_whole():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 128, generator=g)
    x[:, 9] *= 30
    w = torch.randn(48, 128, generator=g) * 0.05
    clipped = awq_clip(x, w, 32)
    assert bool((clipped.abs() <= w.abs()).all()) and bool((clipped.sign() * w.sign() >= 0).all())

    def group_errors(v):  # [N, K/G] squared error of each group's partial products
        d = (int4.fake_quantize(v, 32) - w).reshape(48, 4, 32)
        return (torch.einsum("ngj,tgj->ngt", d, x.reshape(64, 4, 32)) ** 2).mean(-1)

    assert bool((group_errors(clipped) <= group_errors(w) * (1 + 1e-5)).all())
    assert group_errors(clipped).sum() < 0.8 * group_errors(w).sum()


def test_gptq_keeps_the_round_to_nearest_grid_and_lowers_the_output_error():
    g = torch.Generator().manual_seed(11)
    mix = torch.randn(128, 128, generator=g)            # correlated input channels, as in a real layer
    x = torch.randn(512, 128, generator=g) @ mix
    x[:, [3, 70]] *= 10
    w = torch.randn(80, 128, generator=g) * 0.05
    nearest, gptq = int4.quantize(w, 32), gptq_int4(w, x, 32)
    assert torch.equal(gptq.scales, nearest.scales) and torch.equal(gptq.zeros, nearest.zeros)
    assert gptq.q.dtype == torch.uint8 and int(gptq.q.max()) <= 15 and not torch.equal(gptq.q, nearest.q)

    def output_error(found):
        return float((x @ (int4.dequantize(found.q, found.scales, found.zeros) - w).T).pow(2).mean())

    assert output_error(gptq) < 0.8 * output_error(nearest)
    assert gptq.error > nearest.error  # the weights themselves move further: the outputs are what it keeps


def test_fitted_grids_keep_an_exact_grid_and_lower_the_weighted_error():
    g = torch.Generator().manual_seed(12)
    codes = torch.randint(0, 16, (24, 128), generator=g).float()
    codes[:, ::32], codes[:, 1::32] = 0, 15  # every level range used, as in a GGUF Q4_1 block
    scales, lo = torch.rand(24, 4, generator=g) * 0.1 + 0.01, torch.randn(24, 4, generator=g) * 0.1
    on_grid = (codes.reshape(24, 4, 32) * scales[..., None] + lo[..., None]).reshape(24, 128)
    importance = torch.rand(128, generator=g) + 0.1
    fit_scales, fit_lo = fit_int4_grid(on_grid, importance, 32)
    zeros = fit_lo + 8 * fit_scales
    assert torch.allclose(int4.dequantize(gptq_int4(on_grid, torch.randn(64, 128, generator=g), 32,
                                                                (fit_scales, fit_lo)).q, fit_scales, zeros),
                          on_grid, atol=1e-6)  # a Q4_1-style block is kept as it is

    w = torch.randn(40, 128, generator=g)
    w[:, 5] *= 6  # an outlier weight stretches its group's min/max grid
    importance[64:] *= 50

    def weighted_error(scales, low):
        q = torch.round((w.reshape(40, 4, 32) - low[..., None]) / scales[..., None]).clamp(0, 15)
        deq = (q * scales[..., None] + low[..., None]).reshape(40, 128)
        return float((importance * (w - deq) ** 2).sum())

    plain = int4.quantize(w, 32)
    fitted = fit_int4_grid(w, importance, 32)
    assert weighted_error(*fitted) < 0.85 * weighted_error(plain.scales, plain.zeros - 8 * plain.scales)


# ------------------------------------------------------------------ packed layouts through the executor's kernels

def one_linear_graph(w: torch.Tensor, bias: torch.Tensor | None) -> Graph:
    n, k = w.shape
    x, y = Value("x", "f32", ("T", k)), Value("y", "f32", ("T", n))
    weights_ = {"proj.weight": Value("proj.weight", "f32", (n, k))}
    inputs, operands = ["x", "proj.weight"], ["weight"]
    tensors = {"proj.weight": w}
    if bias is not None:
        weights_["proj.bias"] = Value("proj.bias", "f32", (n,))
        inputs.append("proj.bias")
        operands.append("bias")
        tensors["proj.bias"] = bias
    node = Node("proj", "linear", inputs, ["y"], {"in_features": k, "out_features": n, "quant": "none",
                                                    "operands": operands})
    return Graph([x], [node], ["y"], weights_, {"x": x, "y": y}, {}, tensors)


def weight_bound(w: torch.Tensor, scheme: str, group_size: int) -> torch.Tensor:
    """Largest |w - dequantized| each weight may have under `scheme`."""
    if scheme == "int8":
        step = w.abs().amax(1, keepdim=True) / 127
        return step / 2 + F32_SLACK * w.abs()
    if scheme == "int4":
        blocks = w.reshape(w.shape[0], -1, group_size)
        step = ((blocks.amax(-1) - blocks.amin(-1)) / 15).repeat_interleave(group_size, 1)
        return step / 2 + F32_SLACK * (w.abs() + step)
    scale = w.abs().amax(1, keepdim=True) / 448
    return torch.maximum(w.abs() * 2.0 ** -4, scale * 2.0 ** -10) * (1 + F32_SLACK)


@pytest.mark.parametrize("scheme, group_size", [("int8", 32), ("int4", 32), ("int4", 64), ("int4", 128), ("fp8", 32)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_layouts_match_the_float_product_within_the_bit_width(scheme, group_size, with_bias):
    n, k = 40, 384  # N not a multiple of the 16-row panels
    w = weights(n, k, 5, True)
    bias = torch.randn(n) if with_bias else None
    graph = one_linear_graph(w, bias)
    method = {"int8": "int8", "int4": "int4", "fp8": "fp8"}[scheme]
    plan = load_plan().with_overrides("quant", method=method, group_size=group_size)
    passes = {"int8": quantize_int8, "int4": quantize_int4, "fp8": quantize_fp8}
    logical = passes[scheme](graph, PassContext(plan=plan))
    verify(logical)
    node = logical.nodes[0]
    assert node.attrs["quant"] == scheme and node.attrs["layout"] == "logical"
    assert node.inputs[1:3] == ["proj.qweight", "proj.scales"] and (node.inputs[-1] == "proj.bias") == with_bias
    packed = pack_graph(logical)
    verify(packed)
    node = packed.nodes[0]
    assert node.attrs["layout"] != "logical"
    fn = linear.bind_linear(node.attrs, linear.operands_of(node.inputs, node.attrs, packed.tensors))
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(6))
    reference = x.double() @ w.double().T + (bias.double() if with_bias else 0)
    bound = x.double().abs() @ weight_bound(w, scheme, group_size).double().T
    bound += 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-5  # fp32 accumulation in the kernel
    assert bool(((fn(x).double() - reference).abs() <= bound).all())


def test_activation_paths_are_set_on_the_linears_alone():
    # `act` is a linear's activation path but a silu_mul's or a moe's gated activation: the exact (f32) program
    # the build measures against keeps Gemma's GeGLU and a mixture's activation (it once dropped both).
    q8 = {"quant": "int8", "in_features": 64}
    doc = {"nodes": [
        {"op": "linear", "attrs": dict(q8, act="int16")},
        {"op": "logits", "attrs": dict(q8)},
        {"op": "linear", "attrs": dict(q8, in_features=48)},  # not a multiple of 32: f32 always
        {"op": "silu_mul", "attrs": {"act": "gelu_tanh"}},
        {"op": "moe", "attrs": {"act": "silu", "linears": [{"quant": "none", "in_features": 64},
                                                            dict(q8, act="int16")]}},
    ]}
    exact = with_activations(doc, "f32")
    assert [n["attrs"].get("act") for n in exact["nodes"]] == [None, None, None, "gelu_tanh", "silu"]
    assert [e.get("act") for e in exact["nodes"][4]["attrs"]["linears"]] == [None, None]
    int12 = with_activations(doc, "int12")
    assert [n["attrs"].get("act") for n in int12["nodes"]] == ["int12", "int12", None, "gelu_tanh", "silu"]
    assert [e.get("act") for e in int12["nodes"][4]["attrs"]["linears"]] == [None, "int12"]
    assert doc["nodes"][0]["attrs"]["act"] == "int16" and "act" not in doc["nodes"][1]["attrs"]  # a copy
