"""The cuda backend's quantized linears (INT4 and FP8 weights, GEMV and GEMM kernels) under Triton's interpreter,
against runtime.weights' dequantized weights in float64, and the variants the build would record."""

import pytest
import torch

from runtime.backends.cuda.kernels import gemm
from runtime.backends.cuda.launch import InterpreterLauncher, RecordingLauncher
from runtime.weights import fp8, int4

N = 48  # not a multiple of any BLOCK_N: the masks are exercised
EPS32 = torch.finfo(torch.float32).eps


def tolerance(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> float:
    """Bound on |kernel - reference| from what the kernel rounds, relative to the largest sum |x| @ |w|.T.
    f32: the same products summed in another order (and an INT4 weight dequantized with two f32 roundings
    instead of one): far below 16 * eps32 at K <= 256. f16/bf16: the weight tile rounded to the activation
    dtype and the output rounded to it, each a relative eps / 2, so eps."""
    scale = (x.double().abs() @ w.double().abs().T).max().item()
    return (16 * EPS32 if dtype == torch.float32 else torch.finfo(dtype).eps) * scale


def activations(t: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(t, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def weights(k: int, seed: int = 0) -> torch.Tensor:
    """[N, K] with ranges that differ by row and by column, so a scale read from the wrong group shows."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, k, generator=g) * torch.linspace(0.5, 2.0, k) * torch.rand(N, 1, generator=g).add(0.5)


def check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias=None) -> None:
    ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
    assert y.dtype == x.dtype and y.shape == ref.shape
    err = (y.double() - ref).abs().max().item()
    assert err <= tolerance(x, w, x.dtype), err


def kernels_run(launcher: InterpreterLauncher) -> set[str]:
    return {key.split(".")[0] for key in launcher.launched}


# ------------------------------------------------------------------------------------------ int4

def test_pack_int4_layout_and_roundtrip():
    q = torch.tensor([[1, 2, 3, 4], [15, 0, 0, 15]], dtype=torch.uint8)
    assert gemm.pack_int4(q).tolist() == [[0x21, 0x43], [0x0F, 0xF0]]
    q = torch.randint(0, 16, (N, 256), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(gemm.unpack_int4(gemm.pack_int4(q)), q)
    with pytest.raises(ValueError, match="above 15"):
        gemm.pack_int4(q + 1)


@pytest.mark.parametrize("group_size, k", [(32, 128), (64, 256), (128, 256)])
@pytest.mark.parametrize("t", [1, 3, 20])
def test_int4_f32_against_dequantized(group_size, k, t):
    q, scales, zeros, _ = int4.quantize(weights(k), group_size)
    x = activations(t, k, torch.float32, seed=t)
    launcher = InterpreterLauncher()
    y = gemm.linear_int4(launcher, x, gemm.pack_int4(q), scales, zeros, group_size)
    check(y, x, int4.dequantize(q, scales, zeros))
    assert kernels_run(launcher) == {"int4_gemv" if t <= gemm.GEMV_MAX_T else "int4_gemm"}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t", [3, 20])
def test_int4_half_activations_and_bias(dtype, t):
    k, group_size = 256, 64
    q, scales, zeros, _ = int4.quantize(weights(k, seed=2), group_size)
    x = activations(t, k, dtype, seed=3)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(4))
    out = torch.empty(t, N, dtype=dtype)
    y = gemm.linear_int4(InterpreterLauncher(), x, gemm.pack_int4(q), scales, zeros, group_size, bias, out=out)
    assert y is out
    check(y, x, int4.dequantize(q, scales, zeros), bias)


def test_int4_rejects_what_the_kernels_cannot_run():
    q, scales, zeros, _ = int4.quantize(weights(128), 32)
    packed, x = gemm.pack_int4(q), torch.randn(2, 128)
    with pytest.raises(ValueError, match="group_size"):
        gemm.linear_int4(InterpreterLauncher(), x, packed, scales, zeros, 16)
    with pytest.raises(ValueError, match="qweight"):
        gemm.linear_int4(InterpreterLauncher(), x, q, scales, zeros, 32)
    with pytest.raises(ValueError, match="x must be"):
        gemm.linear_int4(InterpreterLauncher(), x.t(), packed, scales, zeros, 32)


# ------------------------------------------------------------------------------------------ fp8

@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("dtype, t", [(torch.float32, 1), (torch.float32, 20), (torch.bfloat16, 3),
                                      (torch.float16, 20), (torch.bfloat16, 20)])
def test_fp8_weight_only_against_dequantized(per_channel, dtype, t):
    k = 128
    q, scales, _, _ = fp8.quantize(weights(k, seed=5), per_channel)
    x = activations(t, k, dtype, seed=6)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(7))
    launcher = InterpreterLauncher()
    check(gemm.linear_fp8(launcher, x, q, scales, bias), x, fp8.dequantize(q, scales), bias)
    assert kernels_run(launcher) == {"fp8_gemv1" if t == 1 else "fp8_gemv" if t <= gemm.GEMV_MAX_T else "fp8_gemm"}


def test_fp8_quantize_rows_rounds_as_torch():
    """Codes equal torch's e4m3 cast (ties to even, carries into the exponent, subnormals), scale = amax / 448."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite()].unique()                        # every finite e4m3 value, ascending
    ties = (grid[1:] + grid[:-1]) / 2                            # every midpoint: a tie in e4m3
    x = torch.cat([grid, ties, torch.randn(384, generator=torch.Generator().manual_seed(8)) * 50])
    x = torch.cat([x, x.new_zeros(-len(x) % 64)])                # 448 in every row: scale 1, codes = the cast
    x = torch.stack([x, -x, x * 0.3])                            # row 2: a scale that is not 1
    x_q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    x_scales = torch.empty(3)
    InterpreterLauncher().launch(gemm.fp8_quantize_rows, (3,), (x, x_q, x_scales), K=x.shape[1], BLOCK_K=64)
    expected_scales = x.abs().amax(1) / fp8.MAX
    assert torch.equal(x_scales, expected_scales)
    expected = (x / expected_scales[:, None]).to(torch.float8_e4m3fn)
    assert torch.equal(x_q.float(), expected.float())  # the values: the kernel may write -0 as +0


@pytest.mark.parametrize("per_channel", [True, False])
def test_fp8_activations_against_quantized_reference(per_channel):
    """fp8_act: x quantized per token (as torch rounds it), the dot exact products summed in f32, then both
    scales; so against the quantized operands in float64 the f32 tolerance holds."""
    k, t = 256, 20
    q, scales, _, _ = fp8.quantize(weights(k, seed=9), per_channel)
    x = activations(t, k, torch.bfloat16, seed=10)
    x_scales = x.float().abs().amax(1) / fp8.MAX
    x_q = (x.float() / x_scales[:, None]).to(torch.float8_e4m3fn)
    launcher = InterpreterLauncher()
    y = gemm.linear_fp8(launcher, x, q, scales, fp8_act=True)
    assert kernels_run(launcher) == {"fp8_quantize_rows", "fp8_gemm"}
    x_deq = x_q.double() * x_scales.double()[:, None]
    ref = x_deq @ fp8.dequantize(q, scales).double().T
    scale = (x_deq.abs() @ fp8.dequantize(q, scales).double().abs().T).max().item()
    # f32 accumulation as above, then the output rounded to bf16 (eps / 2 of |y|)
    assert (y.double() - ref).abs().max().item() <= 16 * EPS32 * scale + torch.finfo(torch.bfloat16).eps * scale
    # and it stays near the unquantized product: e4m3 rounds x by at most 2^-4 relative
    assert (y.double() - x.double() @ fp8.dequantize(q, scales).double().T).abs().max() <= scale / 16


# ------------------------------------------------------------------------------------------ variants

def test_variants_depend_on_model_constants_not_tokens():
    k, meta = 256, {"device": "meta"}
    qweight = torch.empty(N, k // 2, dtype=torch.uint8, **meta)
    scales = torch.empty(N, k // 64, **meta)
    fp8_weight = torch.empty(N, k, dtype=torch.float8_e4m3fn, **meta)

    def keys(t: int) -> tuple[str, ...]:
        recorder = RecordingLauncher()
        x = torch.empty(t, k, dtype=torch.bfloat16, **meta)
        gemm.linear_int4(recorder, x, qweight, scales, scales, 64)
        gemm.linear_fp8(recorder, x, fp8_weight, scales[:, 0].contiguous(), fp8_act=True)
        return tuple(recorder.seen)

    assert keys(2) == keys(8)          # GEMV
    assert keys(20) == keys(40)        # GEMM (+ the activation quantizer)
    assert {key.split(".")[0] for key in keys(1)} == {"int4_gemv", "fp8_gemv1"}  # one token: FP8's own GEMV
    assert {key.split(".")[0] for key in keys(2)} == {"int4_gemv", "fp8_gemv"}
    assert {key.split(".")[0] for key in keys(20)} == {"int4_gemm", "fp8_quantize_rows", "fp8_gemm"}
