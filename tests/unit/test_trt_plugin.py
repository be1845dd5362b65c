"""kiln::PagedAttention's host side (runtime/trt_plugin/kiln_trt_plugins.cpp) run on the CPU: the library is
built with g++, a step is enqueued as TensorRT would enqueue it, and each kernel launch it makes goes (through
its test hook) to Triton's interpreter at the addresses the plugin computed. The result must equal, bit for bit,
the cuda backend's host code launching the same kernels (runtime/backends/cuda/kernels/, themselves tested
against the C kernels): so the plugin's argument order, strides, scratch layout and grids are what the kernels
expect, and its KV writes land in the pools it was given. No GPU is involved; the driver path is not run here."""

from __future__ import annotations

import ctypes
import struct

import pytest
import torch

from builder.targets.tensorrt.plugin_kernels import layer_kernels
from runtime.backends.cuda.kernels import attention, rows
from runtime.backends.cuda.launch import InterpreterLauncher
from runtime.ops.reference import RopeTable
from runtime.trt_plugin import arg_letters, build_library

NH, NKV, HD, BS, BLOCKS = 8, 2, 16, 4, 12
# TensorRT's DataType codes, as the plugin reads them
TRT_TYPES = {torch.float32: 0, torch.float16: 1, torch.int32: 3, torch.int64: 8, torch.bfloat16: 7, torch.int8: 2}
POINTEE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "i32": torch.int32,
           "i64": torch.int64, "fp8e4nv": torch.float8_e4m3fn}
HOOK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                        ctypes.POINTER(ctypes.c_uint64), ctypes.c_int)


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    handle = ctypes.CDLL(str(build_library(tmp_path_factory.mktemp("plugin"))))
    handle.kiln_register_kernel.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_int,
                                            ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    handle.kiln_set_launch_hook.argtypes = [HOOK]
    handle.kiln_test_paged_attention.argtypes = [ctypes.c_char_p] * 3 + [
        ctypes.c_float, ctypes.c_int, ctypes.c_float, ctypes.c_int, ctypes.POINTER(ctypes.c_int64),
        ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p),
        ctypes.c_void_p]
    handle.kiln_last_error.restype = ctypes.c_char_p
    return handle


def make_step(act: torch.dtype, seed: int = 0):
    """Three sequences (context, query): a fresh 5-token prefill, a decode at 9, a 3-token chunk after 4."""
    g = torch.Generator().manual_seed(seed)
    seqs = [(5, 5), (9, 1), (7, 3)]
    tables = torch.tensor([[3, 7, -1], [0, 5, 9], [11, 2, -1]], dtype=torch.int32)
    positions, slots = [], []
    for (ctx, qlen), table in zip(seqs, tables):
        for p in range(ctx - qlen, ctx):
            positions.append(p)
            slots.append(int(table[p // BS]) * BS + p % BS)
    t = len(positions)
    rope = RopeTable(HD, 10000.0, None)
    rope.ensure(32)
    return {
        "q": torch.randn(t, NH * HD, generator=g).to(act), "k": torch.randn(t, NKV * HD, generator=g).to(act),
        "v": torch.randn(t, NKV * HD, generator=g).to(act), "positions": torch.tensor(positions),
        "rope_table": rope.packed[:32].contiguous(),
        "k_cache": torch.randn(BLOCKS, BS, NKV, HD, generator=g).to(act),  # earlier tokens' keys and values
        "v_cache": torch.randn(BLOCKS, BS, NKV, HD, generator=g).to(act),
        "slot_mapping": torch.tensor(slots), "block_tables": tables,
        "context_lens": torch.tensor([c for c, _ in seqs], dtype=torch.int32),
        "query_start_loc": torch.tensor([0, 5, 6, 9], dtype=torch.int32), "kv_scale": torch.tensor(1.0)}


def reference(step: dict, attrs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The cuda backend's host code over the same kernels: rope, kv_write, paged_attention."""
    launcher = InterpreterLauncher()
    k_cache, v_cache = step["k_cache"].clone(), step["v_cache"].clone()
    q, k = rows.rope(launcher, step["q"], step["k"], step["positions"], step["rope_table"], NH, NKV, HD)
    kv_scale = attrs.get("kv_scale", 1.0)
    attention.kv_write(launcher, k, step["v"], k_cache, v_cache, step["slot_mapping"], kv_scale)
    out = torch.full_like(step["q"], float("nan"))
    attention.paged_attention(launcher, out, q, k_cache, v_cache, step["block_tables"], step["context_lens"],
                              step["query_start_loc"], attrs["scale"], num_heads=NH, kv_scale=kv_scale,
                              window=attrs.get("window", 0), max_query_len=5)
    return out, k_cache, v_cache


def run_plugin(library, step: dict, attrs: dict, node: dict, variants: dict) -> tuple[torch.Tensor, int]:
    """Enqueue the plugin over step's tensors; (out, kernel launches). The pools are written in place."""
    for key, (_, variant) in variants.items():
        library.kiln_register_kernel(key.encode(), variant.name.encode(), 4, 0, len(variant.signature) + 2,
                                     arg_letters(variant.signature).encode(), b"", 0)
    names = ["q", "k", "v", "positions", "rope_table", "k_cache", "v_cache", "slot_mapping", "block_tables",
             "context_lens", "query_start_loc", "kv_scale"]
    out = torch.full_like(step["q"], float("nan"))
    workspace = torch.zeros(1 << 16, dtype=torch.uint8)
    buffers = [step[n] for n in names] + [out, workspace]
    launcher, launches = InterpreterLauncher(), []

    def at(address: int, pointee: torch.dtype) -> torch.Tensor:
        """The tensor at `address`: a view into whichever buffer holds it."""
        for buf in buffers:
            flat = buf.view(-1).view(torch.uint8) if buf.dim() else buf.reshape(1).view(torch.uint8)
            offset = address - buf.data_ptr()
            if 0 <= offset < flat.numel():
                size = torch.tensor([], dtype=pointee).element_size()
                return flat[offset:offset + (flat.numel() - offset) // size * size].view(pointee)
        raise AssertionError(f"the plugin passed an address ({address:#x}) outside every buffer it was given")

    def hook(key, gx, gy, gz, bits, count):
        kernel, variant = variants[key.decode()]
        args = []
        for (name, kind), raw in zip(variant.signature, bits[:count]):
            if kind.startswith("*"):
                args.append(at(raw, POINTEE[kind[1:]]))
            elif kind == "fp32":
                args.append(struct.unpack("<f", struct.pack("<I", raw & 0xFFFFFFFF))[0])
            else:
                args.append(ctypes.c_int64(raw).value)
        launcher.allowed = {key.decode()}  # the arguments must make exactly the recorded variant
        launcher.launch(kernel, (gx, gy, gz), args, **dict(variant.constexprs))
        launches.append(variant.name)
        return 0

    callback = HOOK(hook)
    library.kiln_set_launch_hook(callback)
    dims = []
    for n in names:
        shape = list(step[n].shape)
        dims += [len(shape)] + shape + [0] * (8 - len(shape))
    types = [TRT_TYPES[step[n].dtype] for n in names]
    pointers = (ctypes.c_void_p * 12)(*[step[n].data_ptr() for n in names])
    # outputs: out, and the pools' outputs at the pools themselves (TensorRT aliases them)
    outputs = (ctypes.c_void_p * 3)(out.data_ptr(), step["k_cache"].data_ptr(), step["v_cache"].data_ptr())
    try:
        status = library.kiln_test_paged_attention(
            node["rope_kernel"].encode(), node["kv_write_kernel"].encode(), node["attention_kernel"].encode(),
            attrs["scale"], attrs.get("window", 0), node["kv_scale"], node["queries_per_tile"],
            (ctypes.c_int64 * len(dims))(*dims), (ctypes.c_int32 * 12)(*types), pointers, outputs,
            workspace.data_ptr())
    finally:
        library.kiln_set_launch_hook(HOOK())
    assert status == 0, library.kiln_last_error().decode()
    return out, len(launches)


@pytest.mark.parametrize("act,window", [(torch.float32, 0), (torch.float16, 0), (torch.float32, 3)])
def test_the_plugin_computes_what_the_cuda_backend_computes_and_writes_the_pools_in_place(library, act, window):
    attrs = {"num_heads": NH, "num_kv_heads": NKV, "head_dim": HD, "scale": HD ** -0.5, "window": window}
    node, variants = layer_kernels(attrs, {torch.float32: "f32", torch.float16: "f16"}[act], _kv(act), BS)
    step = make_step(act)
    expected, k_expected, v_expected = reference(step, attrs)
    k_pool, v_pool = step["k_cache"], step["v_cache"]
    out, launches = run_plugin(library, step, attrs, node, variants)
    assert launches == 3
    assert torch.equal(out, expected)
    assert step["k_cache"] is k_pool and torch.equal(k_pool, k_expected) and torch.equal(v_pool, v_expected)


def test_a_wrong_queries_per_tile_leaves_queries_unattended(library):
    """The comparison can fail: with a tile twice as wide as the kernel's (8 queries, not 4) the grid has one
    tile where the 5-token prefill needs two, and its last query gets no program (its row stays NaN)."""
    attrs = {"num_heads": NH, "num_kv_heads": NKV, "head_dim": HD, "scale": HD ** -0.5}
    node, variants = layer_kernels(attrs, "f32", "f32", BS)
    step = make_step(torch.float32)
    expected, _, _ = reference(make_step(torch.float32), attrs)
    out, _ = run_plugin(library, step, attrs, dict(node, queries_per_tile=node["queries_per_tile"] * 2), variants)
    assert out[:1].equal(expected[:1]) and out.isnan().any()


def test_an_fp8_cache_arrives_as_int8_codes_and_is_read_as_e4m3(library):
    """The tensorrt target's fp8 pools are int8 tensors of e4m3 codes (the ONNX has no float8 scatter): the plugin
    takes them with TensorRT's INT8 type and its fp8 kernels read and write the same bytes as the cuda backend's
    float8 pools, with the layer's kv_scale."""
    attrs = {"num_heads": NH, "num_kv_heads": NKV, "head_dim": HD, "scale": HD ** -0.5, "kv_scale": 0.5}
    node, variants = layer_kernels(attrs, "f16", "fp8", BS)
    assert node["kv_scale"] == 0.5
    step = make_step(torch.float16)
    for name in ("k_cache", "v_cache"):
        step[name] = (step[name].float() / 0.5).to(torch.float8_e4m3fn)
    expected, k_expected, v_expected = reference(step, attrs)
    step.update(k_cache=step["k_cache"].view(torch.int8), v_cache=step["v_cache"].view(torch.int8))
    out, launches = run_plugin(library, step, attrs, node, variants)
    assert launches == 3 and torch.equal(out, expected)
    assert torch.equal(step["k_cache"], k_expected.view(torch.int8))
    assert torch.equal(step["v_cache"], v_expected.view(torch.int8))


def _kv(act: torch.dtype) -> str:
    return {torch.float32: "f32", torch.float16: "f16"}[act]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="launches the kernels' cubins through the CUDA driver: "
                                                           "needs an NVIDIA GPU (ran on an H100)")
@pytest.mark.parametrize("act,window", [(torch.float32, 0), (torch.bfloat16, 0), (torch.float16, 3)])
def test_on_a_gpu_the_plugin_launches_the_cubins_as_the_cuda_backend_does(library, act, window):
    """The driver path: the layer's variants compiled for this GPU, registered with the library as the tensorrt
    backend registers an engine's kernels/, and one enqueue on CUDA tensors. Its output and pools must equal,
    bit for bit, the cuda backend's CubinLauncher running the same cubins, and the pools stay where they were."""
    from builder.targets.cuda.compile import compile_variant
    from runtime.backends.cuda.launch import CubinLauncher

    cc = "{}.{}".format(*torch.cuda.get_device_capability())
    kv = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}[act]
    attrs = {"num_heads": NH, "num_kv_heads": NKV, "head_dim": HD, "scale": HD ** -0.5, "window": window}
    node, variants = layer_kernels(attrs, kv, kv, BS)
    compiled = {key: compile_variant(kernel, variant, cc) for key, (kernel, variant) in variants.items()}
    for key, ck in compiled.items():
        library.kiln_register_kernel(key.encode(), ck.function.encode(), ck.num_warps, ck.shared, ck.num_params,
                                     arg_letters(ck.variant.signature).encode(), ck.cubin, len(ck.cubin))
    cpu = make_step(act)
    step = {n: t.cuda() for n, t in cpu.items()}
    launcher = CubinLauncher(compiled, torch.device("cuda"))
    k_expected, v_expected = step["k_cache"].clone(), step["v_cache"].clone()
    q, k = rows.rope(launcher, step["q"], step["k"], step["positions"], step["rope_table"], NH, NKV, HD)
    attention.kv_write(launcher, k, step["v"], k_expected, v_expected, step["slot_mapping"])
    expected = torch.full_like(step["q"], float("nan"))
    attention.paged_attention(launcher, expected, q, k_expected, v_expected, step["block_tables"],
                              step["context_lens"], step["query_start_loc"], attrs["scale"], num_heads=NH,
                              window=window, max_query_len=5)

    names = ["q", "k", "v", "positions", "rope_table", "k_cache", "v_cache", "slot_mapping", "block_tables",
             "context_lens", "query_start_loc", "kv_scale"]
    out = torch.full_like(step["q"], float("nan"))
    workspace = torch.zeros(1 << 16, dtype=torch.uint8, device="cuda")
    pools = step["k_cache"].data_ptr(), step["v_cache"].data_ptr()
    dims = []
    for n in names:
        shape = list(step[n].shape)
        dims += [len(shape)] + shape + [0] * (8 - len(shape))
    torch.cuda.synchronize()
    status = library.kiln_test_paged_attention(
        node["rope_kernel"].encode(), node["kv_write_kernel"].encode(), node["attention_kernel"].encode(),
        attrs["scale"], window, node["kv_scale"], node["queries_per_tile"], (ctypes.c_int64 * len(dims))(*dims),
        (ctypes.c_int32 * 12)(*[TRT_TYPES[step[n].dtype] for n in names]),
        (ctypes.c_void_p * 12)(*[step[n].data_ptr() for n in names]),
        (ctypes.c_void_p * 3)(out.data_ptr(), *pools), workspace.data_ptr())
    torch.cuda.synchronize()
    assert status == 0, library.kiln_last_error().decode()
    assert not out.isnan().any()
    assert torch.equal(out, expected)
    assert (step["k_cache"].data_ptr(), step["v_cache"].data_ptr()) == pools
    assert torch.equal(step["k_cache"], k_expected) and torch.equal(step["v_cache"], v_expected)
    assert not torch.equal(step["k_cache"].cpu(), cpu["k_cache"])  # this step's keys were written
