"""The C row ops (rms_norm, add + rms_norm, silu * up) against the torch kernels they replace."""

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


@pytest.mark.parametrize("call,message", [
    (lambda: rowops.rms_norm(torch.randn(2, 8).double(), torch.randn(8), 1e-5), r"x must be float32 \[..., 8\]"),
    (lambda: rowops.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-5), r"x must be float32 \[..., 7\]"),
    (lambda: rowops.rms_norm(torch.randn(2, 8), torch.randn(8).double(), 1e-5), "weight must be a contiguous"),
    (lambda: rowops.add_rms_norm(torch.randn(2, 8), torch.randn(1, 8), torch.randn(8), 1e-5),
     "residual .* must be float32 of the shape of x"),
    (lambda: rowops.silu_mul(torch.randn(2, 7)), "must end in an even size"),
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


def test_reused_outputs_are_kept_per_row_count_and_only_when_asked():
    w = torch.randn(8)
    x1, x1b, x3 = torch.randn(1, 8), torch.randn(1, 8), torch.randn(3, 8)
    kept = rowops.bind_rms_norm(w, 1e-5, reuse=True)
    first = kept(x1)
    second = kept(x1b)
    assert second.data_ptr() == first.data_ptr()  # same rows: the node's buffer again, overwritten
    torch.testing.assert_close(second, reference.rms_norm(x1b, w, 1e-5), rtol=1e-5, atol=1e-6)
    assert kept(x3).data_ptr() != first.data_ptr()
    big = torch.randn(tape.REUSE_ROWS + 1, 8)
    assert kept(big).data_ptr() != kept(big).data_ptr()  # large steps are not kept
    fresh = rowops.bind_rms_norm(w, 1e-5)
    a = fresh(x1)
    b = fresh(x1b)
    assert a.data_ptr() != b.data_ptr()  # both alive: never the same buffer without reuse
