"""The C row ops (rms_norm, add + rms_norm, silu * up, gelu_tanh * up, scale) against the torch kernels they
replace."""

import pytest
import torch

from runtime.ops import reference, rowops, tape


@pytest.mark.parametrize("rows,width", [(1, 576), (3, 7), (200, 576), (64, 1000)])  # 200 x 576 runs threaded
def test_row_ops_match_the_torch_kernels(rows, width):
    g = torch.Generator().manual_seed(rows * width)
    x, residual = torch.randn(rows, width, generator=g) * 3, torch.randn(rows, width, generator=g)
    weight = torch.randn(width, generator=g)
    torch.testing.assert_close(rowops.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5),
                               rtol=1e-5, atol=1e-6)
    normed, total = rowops.add_rms_norm(x, residual, weight, 1e-6)
    expected_normed, expected_total = reference.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(total, expected_total)
    torch.testing.assert_close(normed, expected_normed, rtol=1e-5, atol=1e-6)
    gate_up = torch.randn(rows, 2 * width, generator=g) * 8  # saturates both ends of the sigmoid
    torch.testing.assert_close(rowops.silu_mul(gate_up), reference.silu_mul(gate_up), rtol=1e-5, atol=1e-6)


def test_silu_mul_is_finite_at_extremes():
    gate_up = torch.tensor([[-1e4, -100.0, 0.0, 100.0, 1e4, 1.0, 1.0, 1.0, 1.0, 1.0]])
    torch.testing.assert_close(rowops.silu_mul(gate_up), reference.silu_mul(gate_up))


@pytest.mark.parametrize("rows,width", [(1, 7), (3, 13), (5, 643), (64, 1001)])  # odd: the scalar tail; 64 x 1001 threaded
@pytest.mark.parametrize("magnitude", [1.0, 4.0, 12.0])
def test_gelu_tanh_mul_matches_torch(rows, width, magnitude):
    g = torch.Generator().manual_seed(rows * width)
    gate_up = torch.randn(rows, 2 * width, generator=g) * magnitude
    ours = rowops.silu_mul(gate_up, act="gelu_tanh")
    expected = reference.gated_act("gelu_tanh", gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    # Measured: within 2.5 eps of torch's value where gate > 0. Where gate < 0, torch's 0.5 g (1 + tanh(u))
    # cancels: its tanh's rounding near -1 (eps / 2) times 0.5 |g up| (measured up to eps |g up| / 4); the
    # kernel's g / (1 + exp(-2u)) has no cancellation.
    eps = torch.finfo(torch.float32).eps
    tolerance = 4 * eps * expected.abs() + eps / 2 * (gate * up).abs()
    assert ((ours - expected).abs() <= tolerance).all()


def test_gelu_tanh_mul_at_extremes_is_torch_s_in_the_vector_path_and_the_tail():
    # g^3 overflows: exp(-2u) goes to 0 (out = g) or to inf (out = -0), never NaN for finite g
    gate = torch.tensor([-3e38, -1e20, -1e13, -11.0, 0.0, 1e13, 1e20, 3e38, float("inf"), float("-inf"), float("nan"),
                         1.5, -0.5, 2.0, -1.0, 0.25])
    expected = torch.nn.functional.gelu(gate, approximate="tanh")
    vector = rowops.silu_mul(torch.cat([gate, torch.ones(16)])[None], act="gelu_tanh")[0]  # two vectors of 8
    tail = rowops.silu_mul(torch.stack([gate, torch.ones(16)], dim=1), act="gelu_tanh")[:, 0]  # rows of one
    torch.testing.assert_close(vector, expected, equal_nan=True)
    torch.testing.assert_close(tail, expected, equal_nan=True)


@pytest.mark.parametrize("factor", [25.298221588134766, 0.1, -3.0])  # sqrt(640): Gemma 3 270M's embedding scale
def test_scale_is_torch_s_multiply_in_place(factor):
    x = torch.randn(3, 37, generator=torch.Generator().manual_seed(1)) * 100
    expected = x * factor
    assert rowops.scale_(x, factor) is x
    assert torch.equal(x, expected)


@pytest.mark.parametrize("call,message", [
    (lambda: rowops.rms_norm(torch.randn(2, 8).double(), torch.randn(8), 1e-5), r"x must be float32 \[..., 8\]"),
    (lambda: rowops.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-5), r"x must be float32 \[..., 7\]"),
    (lambda: rowops.rms_norm(torch.randn(2, 8), torch.randn(8).double(), 1e-5), "weight must be a contiguous"),
    (lambda: rowops.add_rms_norm(torch.randn(2, 8), torch.randn(1, 8), torch.randn(8), 1e-5),
     "residual .* must be float32 of the shape of x"),
    (lambda: rowops.silu_mul(torch.randn(2, 7)), "must end in an even size"),
    (lambda: rowops.silu_mul(torch.randn(2, 8), act="gelu"), "act must be one of .'gelu_tanh', 'silu'., got 'gelu'"),
    (lambda: rowops.scale_(torch.randn(2, 8).double(), 2.0), "x must be a contiguous float32"),
    (lambda: rowops.rms_norm(torch.randn(2, 0), torch.randn(0), 1e-5), "rows must hold 1"),
])
def test_row_ops_reject_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_strided_inputs_are_refused_before_any_read():
    """Contiguity is left to the buffer protocol: a strided x cannot be exported, so nothing runs."""
    with pytest.raises((ValueError, BufferError)):
        rowops.rms_norm(torch.randn(8, 2).t(), torch.randn(8), 1e-5)
    with pytest.raises((ValueError, BufferError)):
        rowops.add_rms_norm(torch.randn(2, 8), torch.randn(2, 16)[:, ::2], torch.randn(8), 1e-5)


def test_reused_outputs_share_one_buffer_for_every_row_count_and_only_when_asked():
    w = torch.randn(8)
    x1, x1b, x3 = torch.randn(1, 8), torch.randn(1, 8), torch.randn(3, 8)
    kept = rowops.bind_rms_norm(w, 1e-5, reuse=True)
    first = kept(x1)
    second = kept(x1b)
    assert second.data_ptr() == first.data_ptr()  # same rows: the node's buffer again, overwritten
    torch.testing.assert_close(second, reference.rms_norm(x1b, w, 1e-5), rtol=1e-5, atol=1e-6)
    third = kept(x3)  # another row count: the first rows of the same buffer, so that a tape replays it
    assert third.data_ptr() == first.data_ptr() and third.shape == (3, 8)
    torch.testing.assert_close(third, reference.rms_norm(x3, w, 1e-5), rtol=1e-5, atol=1e-6)
    big = torch.randn(tape.REUSE_ROWS + 1, 8)
    assert kept(big).data_ptr() != kept(big).data_ptr()  # large steps are not kept
    fresh = rowops.bind_rms_norm(w, 1e-5)
    a = fresh(x1)
    b = fresh(x1b)
    assert a.data_ptr() != b.data_ptr()  # both alive: never the same buffer without reuse
