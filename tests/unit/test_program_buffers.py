"""Kept output buffers (runtime.ops.tape.Outputs): a binder that makes one returns its values in it, since
runtime.ops.program.Program gives that buffer to other nodes' values once this one is read."""

import torch

from runtime.ops import linear
from runtime.ops.tape import made_by
from runtime.weights import int8


def test_a_vocabulary_shard_returns_its_rows_in_the_buffer_it_made():
    # A rank's share of a packed table (ids 16..39 of 64): its rows, and zeros for the other ranks' ids, written
    # where its kept Outputs point. A fresh product here failed every tp > 1 step of the shipped model.
    n, k, g = 24, 96, 32
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=generator)
    scales = torch.rand((n, k // g), generator=generator) * 1e-3 + 1e-5
    packed = int8.pack(codes, scales, g)
    attrs = {"quant": "int8", "layout": int8.LAYOUT, "vocab_size": n, "hidden_size": k, "group_size": g,
             "vocab_start": 16, "full_vocab_size": 64}
    with made_by() as made:
        rows = linear.bind_embedding(attrs, packed, reuse=True)
    (outputs,) = made
    ids = torch.tensor([3, 16, 39, 40, 20])
    out = rows(ids)
    assert out.data_ptr() == outputs.for_rows(len(ids)).data_ptr()
    table = int8.dequantize_packed(packed, n, k, g)
    expected = torch.zeros(len(ids), k)
    expected[1:3], expected[4] = table[[0, 23]], table[4]
    assert torch.equal(out, expected)
