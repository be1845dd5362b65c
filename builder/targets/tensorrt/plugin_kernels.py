"""The kernels kiln::PagedAttention runs: Kiln's Triton rope, KV-write and paged-attention kernels
(runtime/backends/cuda/kernels/), as the plugin launches them for one attention layer.

Which variants a layer needs is found the way the cuda target finds its own: the kernels' host functions run
over `meta` tensors shaped and typed as the plugin's inputs (packed q, k, v in the activations' dtype, int64
positions and slots, the packed f32 rope table, pools in the cache dtype) with a RecordingLauncher. The node
names the variants by key; the build compiles them for the plan's compute capability into the engine's
kernels/ (runtime/backends/cuda/kernel_index.py), which the runtime hands to the plugin library.

The plugin passes each kernel's runtime arguments in the order below; `PLUGIN_ARGS` is that order, checked
against every recorded signature so the C++ launch and the kernels cannot drift apart unnoticed.
"""

from __future__ import annotations

import torch

from builder.errors import KilnError
from builder.graph.ir import TORCH_DTYPES
from runtime.backends.cuda.launch import RecordingLauncher

KV_TORCH = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
PLUGIN_ARGS = {
    "_rope_kernel": ("q", "k", "q_out", "k_out", "positions", "table", "q_stride", "k_stride", "q_out_stride",
                     "k_out_stride"),
    "kv_write_kernel": ("k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr", "slot_mapping_ptr", "k_row_stride",
                        "v_row_stride", "num_kv_heads", "kv_scale"),
    "paged_attention_kernel": ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr", "block_tables_ptr",
                               "context_lens_ptr", "query_start_loc_ptr", "out_row_stride", "q_row_stride",
                               "block_table_stride", "num_kv_heads", "scale", "kv_scale", "window"),
}


def layer_kernels(attrs: dict, activations: str, kv_dtype: str, block_size: int) -> tuple[dict, dict]:
    """(the node's kernel attributes, {variant key: (Kernel, Variant)}) for an attention layer's attrs."""
    from runtime.backends.cuda.kernels import attention, rows

    if kv_dtype not in KV_TORCH:
        raise KilnError(f"tensorrt: a {kv_dtype} KV cache has no PagedAttention kernel (it takes "
                        f"{', '.join(KV_TORCH)})")
    nh, nkv, hd = attrs["num_heads"], attrs["num_kv_heads"], attrs["head_dim"]
    act, cache = TORCH_DTYPES[activations], KV_TORCH[kv_dtype]
    launcher = RecordingLauncher()
    tokens = 2

    def meta(*shape, dtype=act):
        return torch.empty(shape, dtype=dtype, device="meta")

    q, k, v = meta(tokens, nh * hd), meta(tokens, nkv * hd), meta(tokens, nkv * hd)
    q_out, k_out = meta(tokens, nh * hd), meta(tokens, nkv * hd)
    pools = meta(4, block_size, nkv, hd, dtype=cache), meta(4, block_size, nkv, hd, dtype=cache)
    kv_scale = float(attrs.get("kv_scale", 1.0)) if kv_dtype == "fp8" else 1.0
    rows.rope(launcher, q, k, meta(tokens, dtype=torch.int64), meta(8, hd, dtype=torch.float32), nh, nkv, hd,
              out=(q_out, k_out))
    attention.kv_write(launcher, k_out, v, *pools, meta(tokens, dtype=torch.int64), kv_scale)
    attention.paged_attention(launcher, meta(tokens, nh * hd), q_out, *pools, meta(1, 2, dtype=torch.int32),
                              meta(1, dtype=torch.int32), meta(2, dtype=torch.int32), attrs["scale"], num_heads=nh,
                              kv_scale=kv_scale, window=int(attrs.get("window", 0)), max_query_len=tokens)
    keys = {}
    for key, variant in launcher.seen.items():
        expected = PLUGIN_ARGS[variant.name]
        if tuple(n for n, _ in variant.signature) != expected:
            raise KilnError(f"tensorrt: kernel {variant.name} takes ({', '.join(n for n, _ in variant.signature)}); "
                            f"the PagedAttention plugin passes ({', '.join(expected)}): update kiln_trt_plugins.cpp")
        keys[variant.name] = key
    node_attrs = {"rope_kernel": keys["_rope_kernel"], "kv_write_kernel": keys["kv_write_kernel"],
                  "attention_kernel": keys["paged_attention_kernel"], "kv_scale": kv_scale,
                  "queries_per_tile": attention.queries_per_tile(nh // nkv)}
    return node_attrs, {key: (launcher.kernels[key], v) for key, v in launcher.seen.items()}


def sampler_kernels(vocab_size: int) -> dict:
    """{variant key: (Kernel, Variant)} of the device sampler a one-rank engine's executor runs on its logits
    (runtime/backends/cuda/sampler.py: greedy, grammar mask, log-probs), so a greedy step copies back token ids,
    not logits."""
    from runtime.backends.cuda.sampler import launch_sampler_kernels

    launcher = RecordingLauncher()
    launch_sampler_kernels(launcher, torch.empty(2, vocab_size, dtype=torch.float32, device="meta"))
    return {key: (launcher.kernels[key], v) for key, v in launcher.seen.items()}

