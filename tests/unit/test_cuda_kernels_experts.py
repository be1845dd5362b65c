"""The cuda backend's expert kernel (expert_gemv) under Triton's interpreter, against torch in float64."""

import pytest
import torch

from runtime.backends.cuda.kernels import experts
from runtime.backends.cuda.launch import InterpreterLauncher

E, N, K = 5, 40, 96  # N and K not multiples of the blocks: the masks are exercised


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows_per_x", [1, 2])
def test_each_slot_reads_its_own_expert(dtype, rows_per_x):
    g = torch.Generator().manual_seed(rows_per_x)
    weights = torch.randn(E, N, K, generator=g).to(dtype)
    x = torch.randn(3, K, generator=g).to(dtype)
    slots = torch.tensor([4, 0, 2, -1, 1, 4][:3 * rows_per_x], dtype=torch.int32)
    y = experts.expert_gemv(InterpreterLauncher(), x, slots, weights, rows_per_x)
    for s, e in enumerate(slots.tolist()):
        expected = torch.zeros(N, dtype=torch.float64) if e < 0 else weights[e].double() @ x[s // rows_per_x].double()
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2 * expected.abs().max().item()
        assert (y[s].double() - expected).abs().max().item() <= tolerance, (s, e)


def test_bad_operands_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"experts must be a contiguous int32 \[4\]"):
        experts.expert_gemv(InterpreterLauncher(), torch.zeros(2, K), torch.zeros(3, dtype=torch.int32),
                            torch.zeros(E, N, K), 2)
