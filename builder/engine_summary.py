"""`engine-build inspect`: an engine's manifest as a readable summary, one labelled section per concern.

The summary reads the manifest's JSON as it is, not through the runtime's `Manifest`, so that it can
show an engine this Kiln cannot run (a newer format version): a section whose fields it cannot read
says so and points at `--json` instead of failing the whole command.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from builder.graph.experts import MIN_EXPERT_TOKENS
from builder.quant import methods
from builder.sources.model import ModelConfig, canonical_weight_shapes
from builder.targets import target as target_module
from runtime.core.sampling import generation_defaults
from runtime.format.engine_format import ENGINE_FORMAT, FORMAT_VERSION, cpu_flags

LABEL_WIDTH = 14  # the label column, as wide as the longest label ("quantization") and two spaces


def format_warning(manifest: dict) -> str | None:
    """Why this Kiln may misread the manifest and `engine-run` refuse it; None when it reads it."""
    if manifest.get("format") != ENGINE_FORMAT:
        return f"manifest format {manifest.get('format')!r} is not {ENGINE_FORMAT!r}; the summary may be wrong"
    version = manifest.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        return (f"engine format version {version} is newer than this Kiln reads ({FORMAT_VERSION}); the summary "
                "may miss or misread fields and engine-run refuses the engine: upgrade Kiln")
    if version < FORMAT_VERSION:
        return (f"engine format version {version} is older than this Kiln reads ({FORMAT_VERSION}); engine-run "
                "refuses the engine: rebuild it")
    return None


def summary_lines(manifest: dict, generation_config: dict | None = None) -> list[str]:
    """The summary `engine-build inspect` prints: a title, then each section under its label (with the request
    defaults of the engine's generation_config.json when given)."""
    lines = [_title(manifest)]
    for label, section in SECTIONS:
        try:
            body = section(manifest)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            body = [f"not readable in this manifest ({type(exc).__name__}: {exc}); see --json"]
        for i, line in enumerate(body):
            lines.append(f"{label if i == 0 else '':<{LABEL_WIDTH}}{line}")
    if generation_config is not None:
        lines.append(f"{'sampling':<{LABEL_WIDTH}}{_sampling_defaults(generation_config)}")
    return lines


def _sampling_defaults(generation_config: dict) -> str:
    given = generation_defaults(generation_config)
    if not given:
        return "generation_config.json sets no sampling defaults: a request's own, else temperature 1, no filters"
    return ("defaults where a request leaves them out (generation_config.json): "
            + ", ".join(f"{k} {v:g}" for k, v in sorted(given.items())))


def tensorrt_lines(manifest: dict) -> list[str]:
    """What a tensorrt build verified and compiled, in a few lines (none for other targets)."""
    if not target_module(manifest["target"]["name"]).WRITES_ONNX:
        return []
    v, trt = manifest["verification"], manifest["tensorrt"]
    lines = [f"not verified: {v['skipped']}" if "skipped" in v else
             f"verified: ONNX Runtime against the cpu engine, max |logit difference| {v['max_abs_logit_diff']:.3g} "
             f"(tolerance {v['tolerance']:.3g}), top-1 agreement {v['top1_agreement']:.0%}"]
    if trt["compiled"]:
        engines = [r["engine"] for r in manifest["ranks"] if r.get("engine")]
        most = max(engines, key=lambda e: e["activation_bytes"] / e["workspace_bytes"])
        lines.append(f"compiled: {trt['flavour']} {trt['version']} for compute capability {trt['compute_capability']} "
                     f"in {sum(trt['build_seconds']):.1f} s: one engine a rank, kiln::PagedAttention bound to its "
                     f"{most['plugin_layers']} attention layers (KV written in place), {most['collectives']} "
                     f"collectives inside it; TensorRT's activation memory {most['activation_bytes'] / 2**20:.1f} MiB "
                     f"of {most['workspace_bytes'] / 2**20:.1f} MiB planned")
    else:
        lines.append("not compiled (--onnx-only): run `engine-build compile DIR` on a GPU host")
    return lines


# ---------------------------------------------------------------------- sections

def _title(m: dict) -> str:
    built = f", built at {m['build_time']} (epoch seconds)" if "build_time" in m else ""
    return (f"{m.get('model', {}).get('name', '?')}: Kiln engine format {m.get('format_version')}, written by Kiln "
            f"{m.get('kiln_version', '?')}, build {str(m.get('build_id', '?'))[:12]}{built}")


def _model(m: dict) -> list[str]:
    model, c = m["model"], m["model"]["config"]
    parameters = _parameter_count(c)
    counted = f", {_count(parameters)} parameters" if parameters else ""
    tied = ", tied embeddings" if c.get("tie_word_embeddings") else ""
    shape = (f"{c['num_layers']} layers, hidden {c['hidden_size']}, intermediate {c['intermediate_size']}, "
             f"{c['num_heads']} query / {c['num_kv_heads']} KV heads x {c['head_dim']}, vocabulary "
             f"{c['vocab_size']:,}{tied}")
    return [f"{model['name']}: {model['architecture']}{counted}, from {model['source']}", shape,
            f"weights sha256 {model['weights_sha256']}", _special_tokens(model.get("special_tokens"))]


def _special_tokens(special: dict | None) -> str:
    if special is None:
        return "raw prompts: special tokens read from the tokenizer files (an engine built before Kiln recorded them)"
    around = [f"{ids} {where}" for where, ids in (("before", special["prefix"]), ("after", special["suffix"])) if ids]
    return f"raw prompts: token ids {' and '.join(around)} the text" if around else "raw prompts: no special tokens added"


def _plan(m: dict) -> list[str]:
    p = m["plan"]
    return [f"{p['target']} target, device {p['device']}, tp {p['tp']} x pp {p['pp']} = {m['world_size']} rank(s)"]


def _limits(m: dict) -> list[str]:
    limits = m["plan"]["limits"]
    return [(f"{limits['max_batch_size']} sequences and {limits['max_num_tokens']:,} tokens a step, "
             f"{limits['max_seq_len']:,} tokens a sequence")]


def _kv_cache(m: dict) -> list[str]:
    kv = m["plan"]["kv_cache"]
    return [(f"{kv['dtype']}, blocks of {kv['block_size']} tokens, {kv['memory_fraction']:g} of the device "
             "memory left after weights and workspace")]


def _quantization(m: dict) -> list[str]:
    q, summary = m["plan"]["quant"], m.get("quantization", {})
    parts = [q["method"]]
    if methods.method(q["method"]).grouped:
        parts.append(f"group size {q['group_size']}")
    if methods.method(q["method"]).calibrated:
        parts.append(f"{q['rounding']} rounding")
    parts.append(f"{q['activations']} activations")
    if q.get("calib"):
        parts.append(f"calibrated on {q['calib']}")
    parts.append(f"excluded: {', '.join(q['exclude'])}" if q["exclude"] else "nothing excluded")
    lines = [", ".join(parts)]
    if summary.get("nodes"):
        nodes = sorted(summary["nodes"].items())
        lines.append("weight nodes: " + ", ".join(f"{count} x {fmt}" for fmt, count in nodes))
    lines += [summary[key] for key in ("compute", "fp8") if summary.get(key)]
    return lines


def _accuracy(m: dict) -> list[str]:
    a = m.get("accuracy")
    if not a:
        return [("none recorded (measured when a build requantizes, narrows the KV cache below f32 or computes "
                 "on integer activations)")]
    if a.get("evaluated") is False:
        return [f"not evaluated: {a['note']} ({a['quantized_nodes']} quantized weight nodes)"]
    gate = ("no gate set" if a.get("max_ppl_increase") is None
            else f"gate: at most +{a['max_ppl_increase']:g}%, passed")
    lines = [(f"perplexity {a['ppl_reference']:.4f} -> {a['ppl_quantized']:.4f} ({a['ppl_increase_pct']:+.3f}%), "
              f"mean KL {a['kl_mean']:.4g} nats a token, on {a['evaluation_tokens']:,} tokens ({gate})")]
    if "greedy_agreement_pct" in a:
        agreed = round(a["greedy_agreement_pct"] * a["greedy_prompts"] / 100)
        greedy_gate = ("no gate set" if a.get("min_greedy_agreement") is None
                       else f"gate: at least {a['min_greedy_agreement']:g}%, passed")
        lines.append(f"greedy chat answers: {agreed} of {a['greedy_prompts']} prompts ({a['greedy_agreement_pct']:.1f}%) "
                     f"give the reference's first {a['greedy_tokens']} tokens, {a['greedy_mean_leading']:.1f} identical "
                     f"leading tokens on average ({greedy_gate})")
    lines += [(f"measured for {a['method']} weights, {a['activations']} activations, {a['kv_cache_dtype']} KV "
              f"cache, {a['quantized_nodes']} quantized weight nodes")]
    if a.get("layer_error"):
        worst = max(a["layer_error"], key=a["layer_error"].get)
        lines.append(f"weight error |w - w'| / |w| per layer: mean {a['layer_error_mean']:.4g}, max "
                     f"{a['layer_error_max']:.4g} ({worst})")
    if a.get("awq_alpha"):
        lines.append(f"AWQ scales fitted for {len(a['awq_alpha'])} layers")
    if a.get("awq_rtn_experts"):
        lines.append(f"{len(a['awq_rtn_experts'])} experts' down projections rounded to nearest: fewer than "
                     f"{MIN_EXPERT_TOKENS} calibration tokens reached them")
    if a.get("kv_scale"):
        scales = a["kv_scale"].values()
        lines.append(f"KV scales calibrated for {len(a['kv_scale'])} layers ({min(scales):.4g} .. {max(scales):.4g})")
    shown = {"evaluated", "note", "max_ppl_increase", "ppl_reference", "ppl_quantized", "ppl_increase_pct", "kl_mean",
             "greedy_agreement_pct", "greedy_prompts", "greedy_tokens", "greedy_mean_leading", "greedy_leading",
             "greedy_chat_template", "min_greedy_agreement",
             "evaluation_tokens", "method", "activations", "kv_cache_dtype", "quantized_nodes", "layer_error",
             "layer_error_mean", "layer_error_max", "awq_alpha", "awq_rtn_experts", "kv_scale"}
    others = {k: v for k, v in sorted(a.items()) if k not in shown and isinstance(v, (int, float, str))}
    if others:
        lines.append("also: " + ", ".join(f"{k} {v}" for k, v in others.items()))
    return lines


def _activation_choice(m: dict) -> list[str]:
    """activations = "auto": the paths timed on the build host, and why one was taken."""
    c = m.get("activation_choice")
    if not c:
        return ["set by the plan" + ("" if "auto" not in target_module(m["plan"]["target"]).ACTIVATIONS else
                                     " (activations = \"auto\" times each cpu path and takes the fastest that "
                                     "keeps the greedy gate)")]
    lines = [f"auto, on the build host's {c['threads']} thread(s): {c['why']}",
             f"{'path':<6} {'decode tok/s':>12} {'prefill tok/s':>13} {'greedy agree':>12} {'ppl':>9} {'KL':>10}"]
    for row in c["paths"]:
        agree, ppl, kl = row["greedy_agreement_pct"], row["ppl_increase_pct"], row["kl_mean"]
        gate = "" if "allowed" not in c else "  allowed" if row["activations"] in c["allowed"] else "  refused"
        lines.append(f"{row['activations']:<6} {row['decode_tok_s']:>12.1f} {row['prefill_tok_s']:>13.1f} "
                     f"{agree:>11.1f}% {ppl:>+8.3f}% {kl:>10.3g}" + ("  exact" if row["exact"] else "") + gate)
    lines.append(f"decode: one sequence after {c['prompt_tokens']} tokens, {c['decode_steps']} steps; prefill: "
                 f"{c['prompt_tokens']} tokens; medians of {c['rounds']} rounds")
    if "allowed" in c:
        lines.append(f"gate: greedy agreement >= {c['gate_greedy_agreement_pct']:g}%, perplexity <= "
                     f"{c['gate_ppl_increase_pct']:+g}%; the serving host times {', '.join(c['allowed'])} at start-up "
                     "and runs the fastest (engine-run --activations picks one of them)")
    return lines


def _ranks(m: dict) -> list[str]:
    lines = []
    sharding = {s["rank"]: s for s in m.get("sharding", {}).get("ranks", [])}
    for r in m["ranks"]:
        if r["file"] is None:
            text = f"rank {r['rank']}: no rank file (not compiled, --onnx-only)"
        else:
            text = (f"rank {r['rank']}: {r['file']} {_size(r['bytes'])} ({r['bytes']:,} bytes), "
                    f"sha256 {r['sha256'][:16]}")
        if "onnx" in r:
            onnx = r["onnx"]
            text += (f"; ONNX {onnx['dir']}/: {len(onnx['files'])} files, {_size(onnx['bytes'])} "
                     f"({onnx['bytes']:,} bytes)")
        if m["world_size"] > 1 and r["rank"] in sharding:
            s = sharding[r["rank"]]
            first, end = s["layers"]
            text += f"; tp rank {s['tp_rank']}, pp rank {s['pp_rank']}, layers {first}..{end - 1}"
        lines.append(text)
    return lines


def _memory(m: dict) -> list[str]:
    max_seq_len = m["plan"]["limits"]["max_seq_len"]
    lines = []
    windows = m["model"]["config"].get("layer_windows") or [0]
    for r in m["memory"]["ranks"]:
        window_bytes = r.get("kv_window_bytes_per_token", 0)
        pools = f"{r['kv_blocks']:,} blocks"
        if "kv_window_bytes_per_token" in r and r.get("kv_window_blocks"):
            pools = (f"{r['kv_blocks']:,} blocks for the full layers and {r['kv_window_blocks']:,} for the "
                     f"{max(windows)}-token window layers (theirs {window_bytes:,} bytes of the token)")
        elif "kv_window_bytes_per_token" in r and window_bytes:
            pools += f" for the {max(windows)}-token window layers (given back behind the window)"
        lines.append(f"rank {r['rank']}: weights {_size(r['weight_bytes'])}, workspace {_size(r['workspace_bytes'])}, "
                     f"KV {r['kv_bytes_per_token']:,} bytes a token: {pools} "
                     f"({r['max_concurrency']:,} sequences of {max_seq_len:,} tokens)")
    return lines


def _requires(m: dict) -> list[str]:
    target = m["target"]
    requires = target.get("requires", {})
    if target_module(target["name"]).DEVICE_KIND == "cpu":
        flags = requires.get("cpu_flags", [])
        missing = sorted(set(flags) - cpu_flags())
        here = f"this CPU lacks {', '.join(missing)}" if missing else "this CPU has them"
        return [f"a CPU with {', '.join(flags)} ({here})" if flags else "any CPU"]
    lines = [f"an NVIDIA GPU of compute capability {requires['compute_capability']} ({requires['gpu_arch']})"]
    if "cuda" in m:  # the cuda target's kernels
        c = m["cuda"]
        lines.append(f"cuda-python, which launches its {c['kernels']} kernels: cubins ({_size(c['cubin_bytes'])}) compiled "
                     f"by Triton {c['triton']} (KILN_CUDA_INTERPRET=1: Triton's interpreter)")
        if c["widened"]:
            lines.append(f"widened to {m['plan']['quant']['activations']} (no GPU kernel for their format): "
                         f"{len(c['widened'])} weight node(s)")
        return lines
    trt = m.get("tensorrt", {})
    if trt.get("compiled"):
        lines.append(f"{trt['flavour']} {trt['version']}, which compiled it in {sum(trt['build_seconds']):.1f} s")
    else:
        lines.append("not compiled yet (--onnx-only): run `engine-build compile DIR` on a GPU host with TensorRT; "
                     "--backend onnxruntime runs its ONNX on the CPU")
    if trt.get("lint"):
        lines.append(f"lint: {trt['lint']}")
    for plugin in trt.get("plugins", []):
        state = "bound to every attention node" if plugin["registered"] else "bound when the engine is compiled"
        lines.append(f"{plugin['namespace']}::{plugin['name']} v{plugin['version']}: {state} (KV pools written in "
                     f"place; {plugin['library']})")
    for r in m["ranks"]:
        if r.get("engine"):
            e = r["engine"]
            lines.append(f"rank {r['rank']}: one engine, {e['collectives']} collectives inside it, TensorRT activation "
                         f"memory {_size(e['activation_bytes'])} of {_size(e['workspace_bytes'])} planned")
    v = m.get("verification")
    if v is not None:
        lines.append(_verification(v))
    return lines


def _verification(v: dict) -> str:
    if "skipped" in v:
        return f"not verified: {v['skipped']}"
    steps = ", ".join(f"{s['step']} ({s['tokens']} tokens)" for s in v.get("steps", []))
    return (f"verified: {v['runner']} against the {v['reference']}: max |logit difference| "
            f"{v['max_abs_logit_diff']:.3g} (tolerance {v['tolerance']:.3g}), top-1 agreement "
            f"{v['top1_agreement']:.0%}" + (f", over {steps}" if steps else ""))


def _passes(m: dict) -> list[str]:
    return [f"{len(m['passes'])}: " + ", ".join(p["name"] for p in m["passes"])]


SECTIONS: list[tuple[str, Callable[[dict], list[str]]]] = [
    ("model", _model), ("plan", _plan), ("limits", _limits), ("kv cache", _kv_cache),
    ("quantization", _quantization), ("activations", _activation_choice), ("accuracy", _accuracy),
    ("ranks", _ranks), ("memory", _memory),
    ("requires", _requires), ("passes", _passes),
]


# ---------------------------------------------------------------------- numbers

def _parameter_count(config: dict) -> int | None:
    """The model's parameters, from its config (None when this Kiln cannot read the config)."""
    try:
        shapes = canonical_weight_shapes(ModelConfig.from_dict(config))
    except (TypeError, ValueError):
        return None
    return sum(math.prod(shape) for shape in shapes.values())


def _count(n: int) -> str:
    for scale, unit in ((1e9, "B"), (1e6, "M")):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:,}"


def _size(n: int) -> str:
    for scale, unit in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
