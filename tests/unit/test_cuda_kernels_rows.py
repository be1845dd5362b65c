"""The cuda backend's row kernels (runtime/backends/cuda/kernels/rows.py) under Triton's interpreter, against
the C row ops (float32) and the torch references.

Tolerances: float32 results match to 1e-6 relative (the same float32 math; the GPU may contract a * b + c
into an fma). float16/bfloat16 results are computed in float32 from the same inputs and rounded once on the
store, so they sit within one unit of the dtype's rounding (finfo.eps relative) of the float32 reference:
half a unit on the GPU (round to nearest even), under a unit in the interpreter, whose float32 -> bfloat16
cast truncates.
"""

import pytest
import torch

from runtime.backends.cuda.kernels import rows
from runtime.backends.cuda.launch import InterpreterLauncher, RecordingLauncher
from runtime.ops import reference, rowops

F32 = {"rtol": 1e-6, "atol": 1e-6}
LOW_PRECISION = [torch.float16, torch.bfloat16]


def rounding(dtype: torch.dtype) -> dict:
    return {"rtol": torch.finfo(dtype).eps, "atol": 1e-5}


def randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def strided(x: torch.Tensor, pad: int = 16) -> torch.Tensor:
    """x as the first columns of a wider buffer: same values, row stride > width."""
    wide = torch.zeros(x.shape[0], x.shape[1] + pad, dtype=x.dtype)
    wide[:, :x.shape[1]] = x
    return wide[:, :x.shape[1]]


@pytest.mark.parametrize("t,h", [(1, 64), (5, 96)])
def test_rms_norm_matches_the_c_kernel(t, h):
    x, weight = randn(t, h, seed=1, scale=3), randn(h, seed=2)
    expected = rowops.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(rows.rms_norm(InterpreterLauncher(), strided(x), weight, 1e-6), expected, **F32)
    out = torch.empty(t, h)
    assert rows.rms_norm(InterpreterLauncher(), x, weight, 1e-6, out=out) is out
    torch.testing.assert_close(out, expected, **F32)


def test_eps_counts():
    x, weight = torch.full((1, 64), 1e-3), torch.ones(64)  # mean(x^2) = 1e-6, the size of eps
    expected = rowops.rms_norm(x, weight, 1e-6)  # 1 / sqrt(2), not 1
    torch.testing.assert_close(rows.rms_norm(InterpreterLauncher(), x, weight, 1e-6), expected, **F32)
    normed, _ = rows.add_rms_norm(InterpreterLauncher(), x, torch.zeros(1, 64), weight, 1e-6)
    torch.testing.assert_close(normed, expected, **F32)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_rms_norm_low_precision(dtype):
    x, weight = randn(5, 96, seed=3, scale=3).to(dtype), randn(96, seed=4)
    ours = rows.rms_norm(InterpreterLauncher(), x, weight, 1e-5)
    assert ours.dtype == dtype
    torch.testing.assert_close(ours.float(), reference.rms_norm(x.float(), weight, 1e-5), **rounding(dtype))


def test_wide_rows_are_walked_in_chunks(monkeypatch):
    monkeypatch.setattr(rows, "ROW_BLOCK", 32)  # 96 columns: three chunks per pass
    x, residual, weight = randn(5, 96, seed=5), randn(5, 96, seed=6), randn(96, seed=7)
    torch.testing.assert_close(rows.rms_norm(InterpreterLauncher(), x, weight, 1e-6), rowops.rms_norm(x, weight, 1e-6),
                               **F32)
    normed, total = rows.add_rms_norm(InterpreterLauncher(), x, residual, weight, 1e-6)
    expected_normed, expected_total = rowops.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(total, expected_total)
    torch.testing.assert_close(normed, expected_normed, **F32)


@pytest.mark.parametrize("t,h", [(1, 64), (5, 96)])
def test_add_rms_norm_matches_the_c_kernel(t, h):
    x, residual, weight = randn(t, h, seed=8, scale=2), randn(t, h, seed=9), randn(h, seed=10)
    normed, total = rows.add_rms_norm(InterpreterLauncher(), strided(x), strided(residual, 32), weight, 1e-6)
    expected_normed, expected_total = rowops.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(total, expected_total)
    torch.testing.assert_close(normed, expected_normed, **F32)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_add_rms_norm_low_precision_normalizes_the_stored_sum(dtype):
    x, residual, weight = randn(5, 64, seed=11).to(dtype), randn(5, 64, seed=12).to(dtype), randn(64, seed=13)
    normed, total = rows.add_rms_norm(InterpreterLauncher(), x, residual, weight, 1e-6)
    if dtype == torch.float16:
        assert torch.equal(total, x + residual)  # one rounding of the float32 sum, as torch's add
    torch.testing.assert_close(total, x + residual, **rounding(dtype))  # bfloat16: the interpreter truncates
    torch.testing.assert_close(normed.float(), reference.rms_norm(total.float(), weight, 1e-6), **rounding(dtype))


@pytest.mark.parametrize("heads,hd", [(4, 16), (2, 24)])
def test_head_rms_norm_matches_the_reference(heads, hd):
    x, weight = randn(5, heads * hd, seed=14, scale=2), randn(hd, seed=15)
    ours = rows.head_rms_norm(InterpreterLauncher(), strided(x), weight, 1e-6)
    torch.testing.assert_close(ours, reference.head_rms_norm(x, weight, 1e-6, hd), **F32)
    half = rows.head_rms_norm(InterpreterLauncher(), x.half(), weight, 1e-6)
    torch.testing.assert_close(half.float(), reference.head_rms_norm(x.half().float(), weight, 1e-6, hd),
                               **rounding(torch.float16))


LONGROPE = {"rope_type": "longrope", "original_max_position_embeddings": 16, "attention_factor": 1.19}


def rope_table(hd: int, longrope: bool) -> reference.RopeTable:
    scaling = None
    if longrope:
        scaling = dict(LONGROPE, short_factor=[1.0 + i / hd for i in range(hd // 2)],
                       long_factor=[2.0 + 3 * i / hd for i in range(hd // 2)])
    table = reference.RopeTable(hd, 10000.0, scaling)
    table.ensure(64)
    return table


def expected_rope(q, k, positions, table, nh, nkv):
    cos, sin = table.lookup(positions.long())
    return reference._rotate(q, cos, sin, nh), reference._rotate(k, cos, sin, nkv)


@pytest.mark.parametrize("nh,nkv,hd,longrope", [(4, 2, 16, False), (2, 1, 24, True), (2, 2, 64, True),
                                                 (1, 1, 96, False)])
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
def test_rope_matches_the_reference(nh, nkv, hd, longrope, pos_dtype):
    table = rope_table(hd, longrope)
    positions = torch.tensor([0, 5, 15, 16, 40], dtype=pos_dtype)  # 16 on: LongRoPE's long factors
    qkv = randn(5, (nh + 2 * nkv) * hd, seed=hd, scale=2)  # a fused projection: q and k are strided views
    q, k = qkv[:, :nh * hd], qkv[:, nh * hd:(nh + nkv) * hd]
    expected_q, expected_k = expected_rope(q, k, positions, table, nh, nkv)
    q_out, k_out = rows.rope(InterpreterLauncher(), q, k, positions, table.packed, nh, nkv, hd)
    torch.testing.assert_close(q_out, expected_q, **F32)
    torch.testing.assert_close(k_out, expected_k, **F32)
    rows.rope(InterpreterLauncher(), q, k, positions, table.packed, nh, nkv, hd, out=(q, k))  # in place
    torch.testing.assert_close(qkv[:, :nh * hd], expected_q, **F32)
    torch.testing.assert_close(qkv[:, nh * hd:(nh + nkv) * hd], expected_k, **F32)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_rope_low_precision(dtype):
    table, nh, nkv, hd = rope_table(24, True), 2, 1, 24
    q, k, positions = randn(1, nh * hd, seed=16).to(dtype), randn(1, nkv * hd, seed=17).to(dtype), torch.tensor([33])
    expected_q, expected_k = expected_rope(q.float(), k.float(), positions, table, nh, nkv)
    q_out, k_out = rows.rope(InterpreterLauncher(), q, k, positions, table.packed, nh, nkv, hd)
    assert q_out.dtype == k_out.dtype == dtype
    torch.testing.assert_close(q_out.float(), expected_q, **rounding(dtype))
    torch.testing.assert_close(k_out.float(), expected_k, **rounding(dtype))


OVERFLOW = pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # numpy's, in the interpreter


@OVERFLOW
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("t,i", [(1, 24), (5, 64)])
def test_gated_act_matches_the_c_kernel(act, t, i):
    gate_up = randn(t, 2 * i, seed=i, scale=6)  # saturates both ends of the sigmoid
    gate_up[0, :4] = torch.tensor([-1e4, -100.0, 100.0, 1e4])  # exp overflow: finite, as torch
    expected = rowops.silu_mul(gate_up, act)
    ours = rows.gated_act(InterpreterLauncher(), act, strided(gate_up))
    torch.testing.assert_close(ours, expected, **F32)
    gate, up = gate_up[:, :i].contiguous(), gate_up[:, i:].contiguous()
    torch.testing.assert_close(rows.gated_act(InterpreterLauncher(), act, gate, up), expected, **F32)
    torch.testing.assert_close(ours, reference.gated_act(act, gate_up), rtol=1e-5, atol=1e-5)


@OVERFLOW
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_gated_act_low_precision(act, dtype):
    gate_up = randn(5, 48, seed=18, scale=4).to(dtype)
    ours = rows.gated_act(InterpreterLauncher(), act, gate_up)
    assert ours.dtype == dtype
    torch.testing.assert_close(ours.float(), reference.gated_act(act, gate_up.float()), **rounding(dtype))


def test_bad_inputs_are_refused_before_launch():
    launcher = InterpreterLauncher()
    with pytest.raises(ValueError, match="weight"):
        rows.rms_norm(launcher, randn(2, 64), randn(64).half(), 1e-6)
    with pytest.raises(ValueError, match="unit column stride"):
        rows.rms_norm(launcher, randn(64, 2).t(), randn(64), 1e-6)
    with pytest.raises(ValueError, match="act"):
        rows.gated_act(launcher, "relu", randn(2, 64))
    assert not launcher.launched


def record(tokens: int) -> set[str]:
    """The variants a Gemma-like layer's row ops ask for at `tokens` tokens, over meta tensors."""
    launcher, meta = RecordingLauncher(), {"device": "meta", "dtype": torch.bfloat16}
    nh, nkv, hd, hidden, inter = 4, 2, 96, 192, 256
    x, weight = torch.empty(tokens, hidden, **meta), torch.empty(hidden, device="meta")
    rows.rms_norm(launcher, x, weight, 1e-6)
    rows.add_rms_norm(launcher, x, torch.empty_like(x), weight, 1e-6)
    qkv = torch.empty(tokens, (nh + 2 * nkv) * hd, **meta)
    q, k = qkv[:, :nh * hd], qkv[:, nh * hd:(nh + nkv) * hd]
    rows.head_rms_norm(launcher, q, torch.empty(hd, device="meta"), 1e-6)
    positions = torch.empty(tokens, dtype=torch.int64, device="meta")
    rows.rope(launcher, q, k, positions, torch.empty(64, hd, device="meta"), nh, nkv, hd)
    gate_up = torch.empty(tokens, 2 * inter, **meta)
    rows.gated_act(launcher, "gelu_tanh", gate_up)
    rows.gated_act(launcher, "gelu_tanh", *gate_up.chunk(2, dim=-1))
    return set(launcher.seen)


def test_variants_do_not_depend_on_the_token_count():
    keys = record(1)
    assert len(keys) == 5  # rms_norm and head_rms_norm: two BLOCKs; both gated_act forms share one variant
    assert record(7) == keys
