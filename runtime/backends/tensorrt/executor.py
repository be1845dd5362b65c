"""The tensorrt backend: a tensorrt-target engine's rank run on an NVIDIA GPU.

NOT YET RUN ON A GPU. Kiln's development machines have none, and TensorRT for RTX refuses the only GPUs lent to
it (Hopper). This module is written against TensorRT's documented Python API; what can be checked without a GPU
is tested (the bindings below, from a real engine's I/O), and tests/e2e/test_tensorrt_gpu.py runs the rest
where a GPU of the engine's compute capability and TensorRT are present.

A rank is one engine (builder/targets/tensorrt/compile.py): its collectives are inside it (TensorRT's
distributed collective layer over an NCCL communicator this executor hands the context), and a pipeline stage's
recv and send are the only steps around it. Each attention layer is Kiln's PagedAttention plugin
(runtime/trt_plugin/), which writes this step's keys and values into the layer's pools in place: a pool is
bound once, as the input `kv.{layer}.{k|v}` and as the output `kv.{layer}.{k|v}.out` (`pool_bindings`), so
every planned KV block is usable and nothing is copied between steps.

Memory: one execution context, whose activation memory is one buffer this executor allocates, of the size the
engine reports (user-managed allocation; the build checked TensorRT's figure against the memory plan). A step:
the metadata copied to the device once, one enqueue, the logits left on the device for the sampler (greedy
steps copy back only their token ids), and one host synchronisation. Decode steps replay CUDA graphs captured
per padded batch size (runtime/backends/cuda/graphs.py), as the cuda backend's do.
"""

from __future__ import annotations

import ctypes
import importlib
import json
from pathlib import Path

import torch

from runtime.backends.base import Executor
from runtime.backends.cpu.executor import KVCacheStorage
from runtime.backends.cuda.graphs import DecodeGraphs
from runtime.backends.cuda.launch import CubinLauncher
from runtime.backends.step import StepMetadata
from runtime.format.engine_format import EngineError, map_rank_file
from runtime.format.kv_groups import KVGroups
from runtime.trt_plugin import load, register_kernels

# engine input -> the DeviceStep field it is bound to, and the type the engine takes
STEP_INPUTS = {"tokens": ("token_ids", torch.int64), "positions": ("positions", torch.int64),
               "slot_mapping": ("slot_mapping", torch.int64), "block_tables": ("block_tables", torch.int32),
               "context_lens": ("context_lens", torch.int32), "query_start_loc": ("query_start_loc", torch.int32),
               "logits_indices": ("logits_indices", torch.int64)}


def require_tensorrt(flavour: str):
    module = "tensorrt" if flavour == "tensorrt" else "tensorrt_rtx_bindings"
    try:
        return importlib.import_module(module)
    except ImportError:
        raise EngineError(f"the tensorrt backend needs {flavour} ({module}) on this host") from None


def pool_layers(io: dict, pool_shapes: dict[str, tuple]) -> list[dict]:
    """The attention layers of an engine's I/O ({"inputs", "outputs", "aliases"}), as KVCacheStorage takes them;
    pool_shapes: each pool input's [blocks, block_size, num_kv_heads, head_dim] (blocks may be -1)."""
    layers = []
    for name in io["inputs"]:
        if name.startswith("kv.") and name.endswith(".k"):
            _, _, nkv, hd = pool_shapes[name]
            layers.append({"layer": int(name.split(".")[1]), "num_kv_heads": int(nkv), "head_dim": int(hd)})
    return layers


def pool_bindings(io: dict, cache: KVCacheStorage) -> dict[str, torch.Tensor]:
    """Every pool tensor of the engine bound to its layer's pool: each input and the output that aliases it get
    the same buffer, so the plugin's in-place writes are what the next step reads. An EngineError if the engine
    has a pool output that does not alias its input (an engine built without the plugin)."""
    bound = {}
    for name in io["inputs"]:
        if name.startswith("kv."):
            _, layer, kind = name.split(".")
            bound[name] = (cache.k if kind == "k" else cache.v)[int(layer)]
    for name in io["outputs"]:
        if name.startswith("kv."):
            source = io["aliases"].get(name)
            if source is None or source not in bound:
                raise EngineError(f"engine output {name} does not alias a pool input: the KV cache would not be "
                                  "written in place; rebuild the engine with this Kiln")
            bound[name] = bound[source]
    return bound


def nccl_capsule(group) -> object:
    """The NCCL communicator of torch.distributed group `group` (its CUDA backend), as the capsule TensorRT's
    set_communicator takes. The group's communicator is made by its first collective."""
    import torch.distributed as dist

    dist.all_reduce(torch.zeros(1, device="cuda"), group=group)
    backend = group._get_backend(torch.device("cuda"))
    pointer = backend._comm_ptr()
    new = ctypes.pythonapi.PyCapsule_New
    new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new(pointer, None, None)


class TensorRTExecutor(Executor):
    """Executor over one rank's engine on CUDA device `device`."""

    max_in_flight = 1

    def __init__(self, rank_file: Path, flavour: str, pools: KVGroups, block_size: int, kv_dtype: str,
                 plugin_library: Path, kernels: dict, collectives: dict | None = None, tp_group=None,
                 device: torch.device | None = None, max_graph_batch: int = 0, device_logits: bool = False):
        if not torch.cuda.is_available():
            raise EngineError("the tensorrt backend needs a CUDA GPU and a CUDA build of torch")
        trt = require_tensorrt(flavour)
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(self.device)
        self.stream = torch.cuda.Stream(self.device)
        self.collectives = collectives or {}

        register_kernels(load(plugin_library, trt), kernels)  # before the engine: its plugins look them up
        loaded = map_rank_file(rank_file)
        doc = json.loads(loaded.program)
        steps = doc["steps"]
        engines = [s for s in steps if "engine" in s]
        if len(engines) != 1:
            raise EngineError(f"{rank_file}: {len(engines)} engines in the rank (an engine built before one engine a "
                              "rank); rebuild it with this Kiln")
        self.io = engines[0]
        self.before = [s for s in steps if s.get("exchange") == "recv"]
        self.after = [s for s in steps if s.get("exchange") == "send"]
        self.outputs = doc["outputs"]
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = self.runtime.deserialize_cuda_engine(loaded.tensors["engine"].numpy().tobytes())
        if self.engine is None:
            raise EngineError(f"{rank_file}: TensorRT cannot deserialize it (another TensorRT version or GPU?); "
                              "rebuild the engine")
        self.dtypes = {n: _torch_dtype(trt, self.engine.get_tensor_dtype(n))
                       for n in self.io["inputs"] + self.io["outputs"]}
        # One context; its activations in one buffer of the size the engine asks for.
        self.context = self.engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
        size = self.engine.device_memory_size_v2
        self.scratch = torch.empty(max(size, 1), dtype=torch.uint8, device=self.device)
        self.context.set_device_memory(self.scratch.data_ptr(), size)
        if tp_group is not None and not self.context.set_communicator(nccl_capsule(tp_group)):
            raise EngineError("TensorRT refused the NCCL communicator of this rank's tensor-parallel group")
        shapes = {n: tuple(self.engine.get_tensor_shape(n)) for n in self.io["inputs"] if n.startswith("kv.")}
        self.cache = KVCacheStorage(pool_layers(self.io, shapes), pools, block_size, kv_dtype, self.device)
        most = min((self.engine.get_tensor_profile_shape(n, 0)[2][0] for n in shapes), default=pools.num_blocks[0])
        if most < self.cache.num_blocks:
            raise EngineError(f"{rank_file}: the engine takes pools of at most {most} blocks, the plan gives "
                              f"{self.cache.num_blocks}; rebuild the engine")
        self.pools = pool_bindings(self.io, self.cache)
        self.step = None
        self.graphs = None
        if max_graph_batch:
            self.graphs = DecodeGraphs(self, max_graph_batch, self.engine.get_tensor_profile_shape(
                "block_tables", 0)[2][1])
        self.device_logits = device_logits
        if device_logits:
            from runtime.backends.cuda.sampler import DeviceSampler

            self.sampler = DeviceSampler(CubinLauncher(kernels, self.device))

    @torch.inference_mode()
    def execute(self, meta: StepMetadata) -> torch.Tensor | None:
        from runtime.backends.cuda.executor import DeviceStep

        with torch.cuda.stream(self.stream):
            if self.graphs is not None and not self.before and self.graphs.takes(meta):
                logits = self.graphs.run(meta)
            else:
                logits = self.run(DeviceStep.of(meta, self.device))
            if logits is not None and not self.device_logits:
                logits = logits.float().cpu()  # the one synchronisation of a step whose logits go to the host
        if logits is not None and self.device_logits:
            self.stream.synchronize()
        return logits

    def run(self, step) -> torch.Tensor | None:
        """The engine over a step already on the device (a DeviceStep); the logits stay there."""
        env = {name: getattr(step, field).to(dtype) for name, (field, dtype) in STEP_INPUTS.items()}
        for item in self.before:  # a pipeline stage's activations from the previous stage
            env[item["output"]] = self.collectives["recv"](item["attrs"]).to(self.device)
        context = self.context
        for name in self.io["inputs"]:
            value = self.pools.get(name)
            if value is None:
                value = env[name] = env[name].to(self.dtypes[name]).contiguous()
            context.set_input_shape(name, tuple(value.shape))
            context.set_tensor_address(name, value.data_ptr())
        for name in self.io["outputs"]:
            value = self.pools.get(name)
            if value is None:
                value = env[name] = torch.empty(tuple(context.get_tensor_shape(name)), dtype=self.dtypes[name],
                                                device=self.device)
            context.set_tensor_address(name, value.data_ptr())
        if not context.execute_async_v3(torch.cuda.current_stream(self.device).cuda_stream):
            raise EngineError("TensorRT could not enqueue a step (see the log above)")
        for item in self.after:
            self.collectives["send"](env[item["input"]], item["attrs"])
        return env.get(self.outputs[0]) if self.outputs else None


def _torch_dtype(trt, dtype) -> torch.dtype:
    table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.int32: torch.int32,
             trt.int64: torch.int64, trt.int8: torch.int8, trt.bool: torch.bool, trt.uint8: torch.uint8}
    for name, torch_dtype in (("bfloat16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
        if hasattr(trt, name):
            table[getattr(trt, name)] = torch_dtype
    return table[dtype]
