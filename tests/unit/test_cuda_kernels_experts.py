"""The cuda backend's expert kernel (expert_gemv) under Triton's interpreter, against torch in float64: float,
INT4 and FP8 experts, each slot reading its own expert (or nothing, for another rank's)."""

import pytest
import torch

from runtime.backends.cuda.kernels import experts, gemm
from runtime.backends.cuda.launch import InterpreterLauncher
from runtime.weights import fp8, int4

E, N, K = 5, 40, 128  # N not a multiple of BLOCK_N: the masks are exercised
SLOTS = [4, 0, 2, -1, 1, 4]


def stacked(fmt: str, dtype: torch.dtype, g: torch.Generator) -> tuple[experts.Experts, torch.Tensor]:
    """Experts of format `fmt` and their dequantized weights [E, N, K] in f64."""
    w = torch.randn(E, N, K, generator=g) * torch.linspace(0.5, 2.0, K)
    if fmt == "float":
        return experts.Experts("float", w.to(dtype)), w.to(dtype).double()
    if fmt == "int4":
        parts = [int4.quantize(w[e], 32) for e in range(E)]
        q = torch.stack([gemm.pack_int4(p[0]) for p in parts])
        scales, zeros = (torch.stack([p[i] for p in parts]) for i in (1, 2))
        ref = torch.stack([int4.dequantize(p[0], p[1], p[2]) for p in parts])
        return experts.Experts("int4", q, scales, zeros, 32), ref.double()
    parts = [fp8.quantize(w[e]) for e in range(E)]
    codes = torch.stack([p[0] for p in parts]).view(torch.uint8)
    scales = torch.stack([p[1].reshape(-1).expand(N) for p in parts]).contiguous()
    ref = torch.stack([fp8.dequantize(p[0], p[1]) for p in parts])
    return experts.Experts("fp8", codes, scales), ref.double()


@pytest.mark.parametrize("fmt", ["float", "int4", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows_per_x", [1, 2])
def test_each_slot_reads_its_own_expert(fmt, dtype, rows_per_x):
    g = torch.Generator().manual_seed(rows_per_x)
    weights, reference = stacked(fmt, dtype, g)
    x = torch.randn(3, K, generator=g).to(dtype)
    slots = torch.tensor(SLOTS[:3 * rows_per_x], dtype=torch.int32)
    y = experts.expert_gemv(InterpreterLauncher(), x, slots, weights, rows_per_x)
    for s, e in enumerate(slots.tolist()):
        expected = torch.zeros(N, dtype=torch.float64) if e < 0 else reference[e] @ x[s // rows_per_x].double()
        bound = (x[s // rows_per_x].double().abs() @ reference[max(e, 0)].abs().T).max().item()
        tolerance = 1e-5 * bound if dtype == torch.float32 else 1e-2 * bound
        assert (y[s].double() - expected).abs().max().item() <= tolerance, (fmt, s, e)


def test_bad_operands_are_refused_in_one_line():
    launcher, w = InterpreterLauncher(), experts.Experts("float", torch.zeros(E, N, K))
    with pytest.raises(ValueError, match=r"experts must be a contiguous int32 \[4\]"):
        experts.expert_gemv(launcher, torch.zeros(2, K), torch.zeros(3, dtype=torch.int32), w, 2)
    with pytest.raises(ValueError, match=r"int4 scales must be f32 \[5, 40, 4\]"):
        bad = experts.Experts("int4", torch.zeros(E, N, K // 2, dtype=torch.uint8), torch.zeros(E, N, 2),
                              torch.zeros(E, N, 4), 32)
        experts.expert_gemv(launcher, torch.zeros(2, K), torch.zeros(2, dtype=torch.int32), bad, 1)
