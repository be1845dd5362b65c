"""An fp8 KV cache in the tensorrt target's ONNX is an int8 pool of e4m3 bit patterns (ONNX has no float8
ScatterND or GatherND). The reference body's encoding, run by ONNX Runtime, must give the e4m3 code of
x / kv_scale exactly as the cuda kernels store it (round to nearest even, saturating at +-448), and its
decoding the value those kernels read: checked here against torch's e4m3 on every code and on values at and
between the codes."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from builder.targets.tensorrt.onnx_attention import FP8_POOL, _Body, _from_cache, _to_cache

onnxruntime = pytest.importorskip("onnxruntime")


def codec_session():
    """x [N] f32, kv_scale [] f32 -> the codes [N] (int8 bytes) the body writes, and the values [N] f32 it reads."""
    b = _Body()
    codes = _to_cache(b, "x", FP8_POOL)
    b("Identity", codes, out="codes")
    b("Identity", _from_cache(b, codes, FP8_POOL), out="values")
    graph = helper.make_graph(
        b.nodes, "fp8_pool",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N"]),
         helper.make_tensor_value_info("kv_scale", TensorProto.FLOAT, [])],
        [helper.make_tensor_value_info("codes", TensorProto.INT8, ["N"]),
         helper.make_tensor_value_info("values", TensorProto.FLOAT, ["N"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    onnx.checker.check_model(model, full_check=True)
    return onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def e4m3_codes(x: torch.Tensor, scale: float) -> torch.Tensor:
    """The cuda kernels' store: x / scale rounded to e4m3, saturated to +-448."""
    return (x / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.int8)


@pytest.mark.parametrize("scale", [1.0, 0.0625, 3.5])
def test_the_body_stores_and_reads_e4m3_codes_as_the_kernels_do(scale):
    session = codec_session()
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    every = every[every.isfinite()]  # the 254 non-NaN codes
    between = (every[:-1] + every[1:]) / 2  # ties: to the even code
    near = torch.cat([every * (1 + 2.0 ** -9), every * (1 - 2.0 ** -9)])
    beyond = torch.tensor([500.0, -500.0, 1e6, -1e6, 464.0, 2.0 ** -10, -(2.0 ** -10), 2.0 ** -12])
    x = torch.cat([every, between, near, beyond,
                   torch.randn(4000, generator=torch.Generator().manual_seed(0)) * 30]) * scale
    codes, values = session.run(None, {"x": x.numpy(), "kv_scale": np.array(scale, np.float32)})
    expected = e4m3_codes(x, scale)
    # -0 and +0 read the same value; the kernels may store either for a value that rounds to zero
    zero = expected.view(torch.float8_e4m3fn).float() == 0
    assert torch.equal(torch.from_numpy(codes)[~zero], expected[~zero])
    assert (torch.from_numpy(codes)[zero] & 0x7F == 0).all()  # +0 or -0
    assert torch.equal(torch.from_numpy(values), expected.view(torch.float8_e4m3fn).float() * scale)
