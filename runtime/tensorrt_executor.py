"""The tensorrt backend: a tensorrt-target engine's compiled rank files run on an NVIDIA GPU.

NOT YET RUN ON A GPU. Kiln's development machines have none; this module is written against
TensorRT's documented Python API (deserialize_cuda_engine, set_input_shape, set_tensor_address,
execute_async_v3) and the engine contract that the onnxruntime backend runs and the tests check on
the CPU. tests/e2e/test_tensorrt_gpu.py runs it where a GPU and TensorRT are present.

A rank file holds one serialized TensorRT engine per ONNX segment (`segmentNN`, u8) and the rank's
program (builder/targets/tensorrt/lower_onnx.py): segments in order, with exchanges (all_reduce, all_gather, send,
recv) between them. A step binds the step metadata and each layer's KV pools, enqueues the segments
on one CUDA stream and runs the exchanges through torch.distributed (NCCL for CUDA tensors).

KV pools: without the PagedAttention plugin TensorRT compiles the node's reference body, whose
ScatterND produces the updated pool as a new tensor. TensorRT does not promise that binding one
address as a ScatterND's data input and as the network output it feeds is safe, so each pool is
double-buffered: a step reads one buffer and writes the other, and the two swap. That costs twice the
pool memory (the executor offers the scheduler half the blocks) and a pool-sized copy per layer per
step: the reason the plugin comes first on a GPU host (docs/tensorrt.md).
"""

from __future__ import annotations

import importlib
import json

import torch

from runtime.backend import Executor
from runtime.engine_format import EngineError, map_rank_file
from runtime.kv_groups import KVGroups
from runtime.step import StepMetadata

_STEP_INPUTS = ("tokens", "positions", "slot_mapping", "block_tables", "context_lens", "query_start_loc",
                "logits_indices")


def require_tensorrt(flavour: str):
    module = "tensorrt" if flavour == "tensorrt" else "tensorrt_rtx_bindings"
    try:
        return importlib.import_module(module)
    except ImportError:
        raise EngineError(f"the tensorrt backend needs {flavour} ({module}) on this host") from None


def _torch_dtypes(trt) -> dict:
    table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.int32: torch.int32,
             trt.int64: torch.int64, trt.int8: torch.int8, trt.bool: torch.bool, trt.uint8: torch.uint8}
    for name, dtype in (("bfloat16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
        if hasattr(trt, name):
            table[getattr(trt, name)] = dtype
    return table


class _Segment:
    def __init__(self, trt, runtime, blob: torch.Tensor, item: dict, dtypes: dict):
        self.engine = runtime.deserialize_cuda_engine(blob.numpy().tobytes())
        if self.engine is None:
            raise EngineError(f"{item['segment']}: TensorRT cannot deserialize it (another TensorRT version or "
                              "GPU?); rebuild the engine")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        self.dtype = {n: dtypes[self.engine.get_tensor_dtype(n)] for n in names}
        self.shape = {n: tuple(self.engine.get_tensor_shape(n)) for n in names}
        self.kv_layers = item["kv_layers"]


class TensorRTExecutor(Executor):
    """Executor over one rank's compiled segments on CUDA device `device`."""

    def __init__(self, rank_file, flavour: str, num_blocks: int, collectives: dict | None = None,
                 device: torch.device | None = None):
        if not torch.cuda.is_available():
            raise EngineError("the tensorrt backend needs a CUDA GPU and a CUDA build of torch")
        trt = require_tensorrt(flavour)
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(self.device)
        self.stream = torch.cuda.Stream(self.device)
        self.collectives = collectives or {}
        loaded = map_rank_file(rank_file)
        doc = json.loads(loaded.program)
        self.outputs = doc["outputs"]
        logger = trt.Logger(trt.Logger.WARNING)
        runtime = trt.Runtime(logger)
        dtypes = _torch_dtypes(trt)
        self.program: list[_Segment | dict] = []
        for item in doc["steps"]:
            if "segment" in item:  # compile_ranks stores the i-th segment's engine as segment{i:02d}
                blob = loaded.tensors[f"segment{sum(isinstance(s, _Segment) for s in self.program):02d}"]
                self.program.append(_Segment(trt, runtime, blob, item, dtypes))
            else:
                self.program.append(item)
        # half the blocks per buffer: each pool is two buffers (see the module docstring); no more than
        # the optimization profile was built for
        self.num_blocks = max(1, num_blocks // 2)
        for segment in self._segments():
            for layer in segment.kv_layers:
                most = segment.engine.get_tensor_profile_shape(f"kv.{layer}.k", 0)[2][0]
                self.num_blocks = min(self.num_blocks, most)
        self.pools: dict[str, list[torch.Tensor]] = {}
        for segment in self._segments():
            for layer in segment.kv_layers:
                for kind in ("k", "v"):
                    name = f"kv.{layer}.{kind}"
                    shape = (self.num_blocks, *segment.shape[name][1:])
                    self.pools[name] = [torch.zeros(shape, dtype=segment.dtype[name], device=self.device)
                                        for _ in range(2)]
        self.cache = _Blocks(self.num_blocks)

    def _segments(self):
        return (item for item in self.program if isinstance(item, _Segment))

    def _exchange(self, item: dict, value: torch.Tensor | None) -> torch.Tensor | None:
        hook = self.collectives.get(item["exchange"])
        if hook is None:
            raise EngineError(f"this rank's program needs {item['exchange']}, which a single-rank run has no peer for")
        if item["exchange"] == "recv":
            return hook(item["attrs"]).to(self.device)
        # in f32, as the onnxruntime backend exchanges them (and verified them): the next segment casts
        return hook(value.float().contiguous(), item["attrs"])

    @torch.inference_mode()
    def execute(self, meta: StepMetadata) -> torch.Tensor | None:
        with torch.cuda.stream(self.stream):
            fields = (meta.token_ids, meta.positions, meta.slot_mapping, meta.block_tables, meta.context_lens,
                      meta.query_start_loc, meta.logits_indices)
            env = {name: t.to(self.device, non_blocking=True) for name, t in zip(_STEP_INPUTS, fields)}
            for item in self.program:
                if isinstance(item, dict):
                    self.stream.synchronize()  # the collectives run on their own streams
                    result = self._exchange(item, env.get(item.get("input")))
                    if item.get("output"):
                        env[item["output"]] = result
                    continue
                self._run(item, env)
            self.stream.synchronize()
        logits = env.get(self.outputs[0]) if self.outputs else None
        return None if logits is None else logits.float().cpu()

    def _run(self, segment: _Segment, env: dict) -> None:
        context, keep = segment.context, []
        pools = {f"kv.{layer}.{kind}" for layer in segment.kv_layers for kind in ("k", "v")}
        for name in segment.inputs:
            if name in pools:
                value = self.pools[name][0]
            else:
                value = env[name].to(segment.dtype[name]).contiguous()
                keep.append(value)
            context.set_input_shape(name, tuple(value.shape))
            context.set_tensor_address(name, value.data_ptr())
        for name in segment.outputs:
            if name.endswith(".out") and name.removesuffix(".out") in pools:
                value = self.pools[name.removesuffix(".out")][1]
            else:
                value = torch.empty(tuple(context.get_tensor_shape(name)), dtype=segment.dtype[name],
                                    device=self.device)
                env[name] = value
            context.set_tensor_address(name, value.data_ptr())
        if not context.execute_async_v3(self.stream.cuda_stream):
            raise EngineError("TensorRT could not enqueue a step (see the log above)")
        for name in pools:  # the written buffer is the next step's input
            self.pools[name].reverse()
        del keep  # inputs stay referenced until enqueued; the stream orders their reuse


class _Blocks:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.groups = KVGroups((0,), (num_blocks,))  # one pool: every layer reads the one block table
