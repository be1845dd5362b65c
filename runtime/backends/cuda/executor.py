"""CudaExecutor: one rank's program on a GPU (or, for tests, in Triton's interpreter on the CPU), with the KV
pools in device memory, updated in place, and decode steps replayed as CUDA graphs (runtime/backends/cuda/graphs.py).

Weights are copied once from the memory-mapped rank file to the device. A step's metadata is copied to the
device once (DeviceStep) and every kernel reads it there; the logits come back to the host as f32 for the
sampler.
"""

from __future__ import annotations

import json

import torch

from runtime.backends.base import Executor
from runtime.backends.cuda.graphs import DecodeGraphs
from runtime.backends.cuda.kernels import attention, rows
from runtime.backends.cuda.launch import ALIGNMENT, Launcher
from runtime.backends.cuda.ops import OpContext, make_binders
from runtime.backends.cuda.sampler import DeviceSampler, launch_sampler_kernels
from runtime.backends.cuda.step import DeviceStep
from runtime.format.engine_format import RankFile
from runtime.backends.cpu.executor import KVCacheStorage
from runtime.format.kv_groups import KVGroups
from runtime.ops import reference
from runtime.ops.program import Hooks, Program, attention_layers
from runtime.backends.step import StepMetadata

ACTIVATION_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
KV_DTYPES = ("f32", "f16", "bf16", "fp8")
INTERPRETER_MULTIPROCESSORS = 4  # the split count's "GPU" where there is none (the interpreter, a build's dry run)


def _placed(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A weight on the device; where that is the host (the interpreter), a copy when the mapped file's 8-byte
    alignment is short of the kernels' 16 (device allocations are always aligned)."""
    if t.device == device or device.type == "meta" and t.device.type == "meta":
        return t.clone() if t.device.type == "cpu" and t.data_ptr() % ALIGNMENT else t
    return t.to(device)


def _holds(launcher: Launcher, k) -> bool:
    """Whether the launcher can run kernel k: any kernel (the interpreter, a recording), or a compiled variant."""
    return launcher.allowed is None or any(key.split(".")[0] == k.name for key in launcher.allowed)


class CudaExecutor(Executor):
    max_in_flight = 1

    def __init__(self, rank_file: RankFile, pools: KVGroups, block_size: int, kv_dtype: str, activations: str,
                 max_seq_len: int, launcher: Launcher, collectives: dict | None = None, max_graph_batch: int = 0,
                 device_logits: bool = False):
        """max_graph_batch: decode steps of up to this many sequences replay CUDA graphs (0: none). device_logits:
        execute() leaves the logits on the device for `self.sampler` (a one-rank engine's; ranks send theirs to
        rank 0 as host tensors)."""
        doc = json.loads(rank_file.program)
        self.launcher, self.device = launcher, launcher.device
        self.activations, self.dtype = activations, ACTIVATION_DTYPES[activations]
        self.kv_quantized = kv_dtype == "fp8"
        self.max_positions = max_seq_len
        tensors = {name: _placed(t, self.device) for name, t in rank_file.tensors.items()}  # weights: copied once
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv cache dtype {kv_dtype!r} has no cuda kernels ({', '.join(KV_DTYPES)})")
        # One pool (runtime/backends/cuda: WINDOWED_POOLS is False): windowed layers read the full block table
        # and the attention kernel masks by position.
        self.cache = KVCacheStorage(attention_layers(doc), pools, block_size, kv_dtype, self.device)
        self.rope_tables: dict[tuple, torch.Tensor] = {}   # one per distinct rope, shared by its layers
        # Decode steps split each context over the multiprocessors, and RoPE writes the keys into the pools, unless
        # the engine's kernels predate those kernels (then paged_attention, and rope + kv_write, as compiled).
        self.split_decode = _holds(launcher, attention.paged_attention_split_kernel)
        self.fused_rope = _holds(launcher, attention.rope_kv_write_kernel)
        self.multiprocessors = (torch.cuda.get_device_properties(self.device).multi_processor_count
                                if self.device.type == "cuda" else INTERPRETER_MULTIPROCESSORS)
        self.step: DeviceStep | None = None
        hooks = Hooks(attention=self._attention, gather_last=self._gather_last, qkv_attention=self._qkv_attention,
                      **self._collectives(collectives or {}))
        self.program = Program(doc, tensors, hooks, binders=make_binders(OpContext(launcher, self.dtype,
                                                                                   self._rope_table)))
        self.graphs = DecodeGraphs(self, max_graph_batch, -(-max_seq_len // block_size)) if max_graph_batch else None
        self.device_logits = device_logits
        if device_logits:
            self.sampler = DeviceSampler(launcher)

    @torch.inference_mode()
    def execute(self, meta: StepMetadata, inputs: dict[str, torch.Tensor] | None = None) -> torch.Tensor | None:
        if meta.positions.numel() and int(meta.positions.max()) >= self.max_positions:
            raise ValueError(f"position {int(meta.positions.max())} is past the engine's max_seq_len "
                             f"{self.max_positions}")
        if self.graphs is not None and not inputs and self.graphs.takes(meta):
            logits = self.graphs.run(meta)
        else:
            logits = self.run(DeviceStep.of(meta, self.device), inputs)
        if logits is None:
            return None
        return logits.float() if self.device_logits else logits.float().cpu()

    def run_meta(self, meta: StepMetadata) -> None:
        """A step over meta tensors, its device sampler's kernels too (greedy, grammar mask, log-probs): what a
        build's dry run records (builder/targets/cuda/compile.py)."""
        logits = self.run(DeviceStep.of(meta, self.device))
        if logits is not None and self.device_logits:
            launch_sampler_kernels(self.launcher, logits.float())

    def run(self, step: DeviceStep, inputs: dict[str, torch.Tensor] | None = None) -> torch.Tensor | None:
        """The program over a step already on the device; its logits stay there."""
        self.step = step
        env = {"tokens": step.token_ids, "positions": step.positions}
        if inputs:
            env.update(inputs)
        try:
            outputs = self.program.run(env)
        finally:
            self.step = None
        return outputs[0] if outputs else None

    # ------------------------------------------------------------------ hooks

    def _rope_table(self, attrs: dict) -> torch.Tensor:
        """cos | sin rows [max_seq_len, head_dim] of a rope, on the device (built once: graphs read it in place)."""
        scaling = attrs.get("scaling")
        key = (attrs["head_dim"], float(attrs["theta"]), reference.scaling_key(scaling))
        if key not in self.rope_tables:
            table = reference.RopeTable(attrs["head_dim"], attrs["theta"], scaling)
            table.ensure(self.max_positions)
            self.rope_tables[key] = table.packed[:self.max_positions].contiguous().to(self.device)
        return self.rope_tables[key]

    def _gather_last(self, x: torch.Tensor) -> torch.Tensor:
        return x.index_select(0, self.step.logits_indices)

    def _kv_scale(self, attrs: dict) -> float:
        return float(attrs.get("kv_scale", 1.0)) if self.kv_quantized else 1.0

    def _attend(self, attrs: dict, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None) -> torch.Tensor:
        """Write this step's k and v into the layer's pool (k None: already written), then attend q over it."""
        step, layer, kv_scale = self.step, attrs["layer"], self._kv_scale(attrs)
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]
        if k is not None:
            attention.kv_write(self.launcher, k, v, k_cache, v_cache, step.slot_mapping, kv_scale)
        out = torch.empty(q.shape[0], attrs["num_heads"] * attrs["head_dim"], dtype=self.dtype, device=self.device)
        if step.max_query_len == 1 and self.split_decode:  # a decode step: each context split over the GPU
            splits = attention.decode_splits(step.context_lens.shape[0], k_cache.shape[2], self.multiprocessors)
            attention.decode_attention(self.launcher, out, q, k_cache, v_cache, step.block_tables, step.context_lens,
                                       step.query_start_loc, attrs["scale"], num_heads=attrs["num_heads"],
                                       splits=splits, kv_scale=kv_scale, window=attrs.get("window", 0))
            return out
        attention.paged_attention(self.launcher, out, q, k_cache, v_cache, step.block_tables, step.context_lens,
                                  step.query_start_loc, attrs["scale"], num_heads=attrs["num_heads"],
                                  kv_scale=kv_scale, window=attrs.get("window", 0), max_query_len=step.max_query_len)
        return out

    def _attention(self, attrs: dict):
        return lambda q, k, v: self._attend(attrs, q, k, v)

    def _qkv_attention(self, rope: dict, attrs: dict, qk_norm: tuple | None = None):
        """split (+ Gemma's q/k norms) + rope + KV write + attention over the fused projection (or q, k, v)."""
        table = self._rope_table(rope)
        nh, nkv, hd = attrs["num_heads"], attrs["num_kv_heads"], attrs["head_dim"]
        norms = None if qk_norm is None else (qk_norm[0].to(self.device), qk_norm[1].to(self.device), qk_norm[2])

        def run(*inputs: torch.Tensor) -> torch.Tensor:
            positions = inputs[-1]
            if len(inputs) == 2:  # [T, (nh + 2 nkv) hd]: column views, read through their row stride
                q, k, v = inputs[0].split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            else:
                q, k, v = inputs[:3]
            if norms is not None:
                q = rows.head_rms_norm(self.launcher, q, norms[0], norms[2])
                k = rows.head_rms_norm(self.launcher, k, norms[1], norms[2])
            if self.fused_rope:  # one launch: q rotated in place, k rotated on its way into the pool
                layer = attrs["layer"]
                attention.rope_kv_write(self.launcher, q, k, v, self.cache.k[layer], self.cache.v[layer],
                                        positions.contiguous(), table, self.step.slot_mapping, nh, self._kv_scale(attrs))
                return self._attend(attrs, q, None, None)
            q, k = rows.rope(self.launcher, q, k, positions, table, nh, nkv, hd)
            return self._attend(attrs, q, k, v)

        return run

    def _collectives(self, hooks: dict) -> dict:
        """Stages hand each other activations in this executor's dtype (the IR types them f32: the cpu
        target's), so a bf16 engine sends half the bytes."""
        out = dict(hooks)
        if "recv" in hooks:
            out["recv"] = lambda attrs: hooks["recv"](dict(attrs, dtype=self.activations))
        return out
