"""The onnxruntime backend: a tensorrt-target engine's per-rank ONNX run on the CPU with ONNX Runtime.

A rank's `program.json` (written by builder/targets/tensorrt/lower_onnx.py) lists its segments and the exchanges
between them. `OnnxRank` runs one step of it: the segments through ONNX Runtime sessions, the
exchanges through a callable the caller supplies (torch.distributed in rank processes, an
in-process group when the builder verifies every rank in one process). `OnnxExecutor` is the
Executor LLMEngine drives, with the same scheduler, in-flight batching and paged KV cache as the
cpu target.

Each attention layer's K and V pools are allocated once, zeroed, and bound as both the input and the
output of their `kiln::PagedAttention` node, so ONNX Runtime's ScatterND writes a step's keys and
values in place: nothing is copied per step.

No weight is dequantized on every step. ONNX Runtime fuses a block-INT4 DequantizeLinear -> MatMul into
its n-bit kernel, which keeps the weights 4-bit and widens them inside the product; any other weight
DequantizeLinear (int8 per channel, fp8) it computes once, at load, into a float weight: the values the
node gives, held in f32 (ONNX Runtime runs f16 MatMuls in f32 on the CPU). SmolLM2-135M with f16
activations, one sequence on one thread: INT8 6 -> 22 tok/s, FP8 2.4 -> 22 (INT8 holds 0.5 GB more).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from runtime.backends.base import Executor
from runtime.format.engine_format import EngineError
from runtime.backends.step import StepMetadata
from runtime.format.kv_groups import KVGroups

# ONNX element type of the KV pools -> the numpy dtype of their zeroed storage (bit patterns for
# the types numpy lacks: ONNX Runtime takes them with ortvalue_from_numpy_with_onnx_type). An fp8 cache's pools
# are int8, holding e4m3 bit patterns (builder/targets/tensorrt/onnx_attention.py).
_POOL_STORAGE = {1: np.float32, 10: np.float16, 16: np.uint16, 3: np.int8}
_ONNX_TYPES = {"tensor(float)": 1, "tensor(float16)": 10, "tensor(bfloat16)": 16, "tensor(int8)": 3}
_NUMPY_OF = {"tensor(float)": np.float32, "tensor(float16)": np.float16}

# (op, attrs, array or None) -> the array the exchange gives back (None for send)
Exchange = Callable[[str, dict, np.ndarray | None], np.ndarray | None]


def require_onnxruntime():
    try:
        import onnxruntime
    except ImportError:
        raise EngineError("the onnxruntime backend needs ONNX Runtime: pip install -e \".[tensorrt]\" "
                          "(or pip install onnx onnxruntime)") from None
    return onnxruntime


@dataclass
class _Segment:
    session: object
    inputs: list[str]
    outputs: list[str]
    kv_layers: list[int]
    input_types: dict[str, str]


class OnnxRank:
    """One rank's lowered program: sessions, KV pools, and `run(meta, exchange)` for one step."""

    def __init__(self, directory: Path, num_blocks: int, num_threads: int | None = None):
        ort = require_onnxruntime()
        self.ort = ort
        try:
            doc = json.loads((directory / "program.json").read_text())
            self.program, self.outputs = doc["steps"], doc["outputs"]
        except (OSError, ValueError, KeyError) as exc:
            raise EngineError(f"{directory}: cannot read program.json ({exc}); rebuild the engine") from None
        threads = num_threads or torch.get_num_threads()
        self.segments: list[_Segment | dict] = []
        self.pools: dict[str, object] = {}  # KV input name -> OrtValue (bound as input and output)
        self.num_blocks = num_blocks
        for item in self.program:
            if "segment" not in item:
                self.segments.append(item)
                continue
            path = directory / item["segment"]
            try:
                session = ort.InferenceSession(str(path), session_options(ort, path, threads),
                                               providers=["CPUExecutionProvider"])
            except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own types
                raise EngineError(f"{path}: ONNX Runtime cannot load it ({' '.join(str(exc).split())[:300]})") from None
            types = {i.name: i.type for i in session.get_inputs()}
            for layer in item["kv_layers"]:
                for name in (f"kv.{layer}.k", f"kv.{layer}.v"):
                    self.pools[name] = self._pool(session, name, types[name])
            self.segments.append(_Segment(session, item["inputs"], item["outputs"], item["kv_layers"], types))

    def _pool(self, session, name: str, onnx_type: str):
        shape = next(i.shape for i in session.get_inputs() if i.name == name)
        element = _ONNX_TYPES.get(onnx_type)
        if element is None:
            raise EngineError(f"KV pool {name}: type {onnx_type} is not one this backend allocates")
        storage = np.zeros([self.num_blocks, *shape[1:]], dtype=_POOL_STORAGE[element])
        return self.ort.OrtValue.ortvalue_from_numpy_with_onnx_type(storage, element)

    def run(self, meta: StepMetadata, exchange: Exchange) -> np.ndarray | None:
        """One step; the logits [N, vocab] f32 on the rank that computes them, else None."""
        env: dict[str, np.ndarray] = {
            "tokens": meta.token_ids.numpy(), "positions": meta.positions.numpy(),
            "slot_mapping": meta.slot_mapping.numpy(), "block_tables": meta.block_tables.numpy(),
            "context_lens": meta.context_lens.numpy(), "query_start_loc": meta.query_start_loc.numpy(),
            "logits_indices": meta.logits_indices.numpy(),
        }
        for item in self.segments:
            if isinstance(item, dict):
                result = exchange(item["exchange"], item["attrs"], env.get(item.get("input")))
                if item.get("output"):
                    env[item["output"]] = result
                continue
            binding = item.session.io_binding()
            for name in item.inputs:
                value = env[name]
                wanted = _NUMPY_OF.get(item.input_types[name])
                if wanted is not None and value.dtype != wanted:
                    value = value.astype(wanted)  # an exchange hands back f32
                binding.bind_cpu_input(name, np.ascontiguousarray(value))
            for name in item.outputs:
                binding.bind_output(name)
            for layer in item.kv_layers:
                for kind in ("k", "v"):
                    pool = self.pools[f"kv.{layer}.{kind}"]
                    binding.bind_ortvalue_input(f"kv.{layer}.{kind}", pool)
                    binding.bind_ortvalue_output(f"kv.{layer}.{kind}.out", pool)
            item.session.run_with_iobinding(binding)
            values = binding.get_outputs()
            env.update((name, values[i].numpy()) for i, name in enumerate(item.outputs))
        return env[self.outputs[0]] if self.outputs else None  # a pipeline stage before the last sends


def session_options(ort, path: Path, threads: int):
    """ONNX Runtime's options for the segment at `path`."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    # ONNX Runtime fuses DequantizeLinear -> MatMul into its n-bit kernel; its default accuracy level
    # quantizes the activations to int8 on the way. Level 1 keeps them f32: the model's own numerics.
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "1")
    if not _has_block_dequantize(path):
        # Without its QDQ rewrites, ONNX Runtime's constant folding computes each weight DequantizeLinear once,
        # at load. With them it keeps an fp8 one as a node that dequantizes the whole weight every step, and
        # takes int8 per channel into its 8-bit n-bit kernel, which decodes at a quarter of the folded speed.
        options.add_session_config_entry("session.disable_quant_qdq", "1")
    return options


def _has_block_dequantize(path: Path) -> bool:
    """Whether the segment has a block-quantized (INT4) DequantizeLinear, which ONNX Runtime's n-bit kernel runs
    faster than a MatMul of the folded float weight (SmolLM2-135M, f16 activations: 31 tok/s against 21)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    return any(node.op_type == "DequantizeLinear" and any(a.name == "block_size" and a.i for a in node.attribute)
               for node in graph.node)


class KVPools:
    """What LLMEngine reads of a cache: the number of blocks its scheduler hands out."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.groups = KVGroups((0,), (num_blocks,))  # one pool: every layer reads the one block table


class OnnxExecutor(Executor):
    """Executor over one rank's OnnxRank; `collectives` (rank processes) performs its exchanges."""

    def __init__(self, directory: Path, num_blocks: int, num_threads: int | None = None,
                 collectives: dict | None = None):
        self.rank = OnnxRank(directory, num_blocks, num_threads)
        self.cache = KVPools(num_blocks)
        self.collectives = collectives or {}

    def _exchange(self, op: str, attrs: dict, value: np.ndarray | None) -> np.ndarray | None:
        hook = self.collectives.get(op)
        if hook is None:
            raise EngineError(f"this rank's program needs {op}, which a single-rank run has no peer for")
        if op == "recv":
            return hook(attrs).numpy()
        result = hook(torch.from_numpy(np.ascontiguousarray(value, dtype=np.float32)), attrs)
        return None if result is None else result.numpy()

    @torch.inference_mode()
    def execute(self, meta: StepMetadata) -> torch.Tensor | None:
        logits = self.rank.run(meta, self._exchange)
        return None if logits is None else torch.from_numpy(logits)
