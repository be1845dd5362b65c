"""Choose activations (analysis, cpu target, activations = "auto"): time each activation path of the quantized,
fused program on this host, measure the accuracy of those that round activations, and record the paths the gate
allows and the fastest of them here (builder/measure/activation_choice.py) in graph.meta["activation_choice"]. The program
is packed on f32 activations whatever this host found (its bytes do not depend on a timing, and ranks built apart
agree); measure_accuracy reuses f32's figures."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import torch

from builder.measure import activation_choice as choice
from builder.measure.accuracy import answers_path
from builder.measure.calibration import chat_prompts, evaluation_windows, progress
from builder.graph.ir import Graph
from passes.context import PassContext
from passes.measure_accuracy import evaluated, is_exact
from runtime import __version__


# The figures of a path that loses nothing (not evaluated)
EXACT = {"greedy_agreement_pct": 100.0, "ppl_increase_pct": 0.0, "kl_mean": 0.0}


def choose_activations(graph: Graph, ctx: PassContext) -> Graph:
    out = graph.replace()
    out.meta["activations"] = "f32"  # the program's bytes: the host that serves it picks its path at start-up
    quant = ctx.plan.quant
    modes = choice.candidates(out)
    if len(modes) == 1 or ctx.only_rank not in (None, 0):  # no choice; or a rank built apart: rank 0 measures
        return out
    speeds, figures = measure(out, ctx, modes)
    rows = [{"activations": mode, "decode_tok_s": round(speeds[mode].decode_tok_s, 1),
             "prefill_tok_s": round(speeds[mode].prefill_tok_s, 1),
             **{key: figures.get(mode, EXACT)[key] for key in EXACT}, "exact": mode not in figures} for mode in modes]
    allowed = choice.allowed({mode: figures.get(mode) for mode in modes}, quant.min_greedy_agreement,
                             quant.max_ppl_increase)
    chosen, why = choice.choose(speeds, allowed)
    f32 = figures.get("f32", EXACT)
    out.meta["activation_choice"] = {
        "chosen": chosen, "why": why, "allowed": allowed,
        "gate_greedy_agreement_pct": (quant.min_greedy_agreement if quant.min_greedy_agreement is not None
                                      else f32["greedy_agreement_pct"]),
        "gate_ppl_increase_pct": (quant.max_ppl_increase if quant.max_ppl_increase is not None
                                  else round(f32["ppl_increase_pct"] + choice.PPL_MARGIN, 6)),
        "threads": torch.get_num_threads(), "prompt_tokens": choice.PROMPT_TOKENS,
        "decode_steps": choice.DECODE_STEPS, "rounds": choice.ROUNDS, "paths": rows}
    out.meta["activation_figures"] = {mode: f for mode, f in figures.items() if mode == "f32"}
    return out


def measure(out: Graph, ctx: PassContext, modes: list[str]) -> tuple[dict, dict]:
    """(path -> its Speed here, path -> its accuracy figures, exact paths left out): from Kiln's cache when the same
    whole program was measured on this host before (the same model, quantization, cache and evaluation: builds of
    other tp, pp or ep shapes share it), else measured and kept."""
    kv_dtype = ctx.plan.kv_cache.dtype
    requantized = out.meta.get("source_requantized", [])
    prompts, _ = chat_prompts(ctx.model)
    key = {"model": ctx.model.weights_sha256(), "kv": kv_dtype, "modes": modes, "threads": torch.get_num_threads(),
           "program": [(n.name, n.op, n.attrs.get("quant", "none"), n.attrs.get("group_size")) for n in out.nodes],
           "quant": {k: v for k, v in dataclasses.asdict(ctx.plan.quant).items()
                     if k not in ("activations", "max_ppl_increase", "min_greedy_agreement")},
           "evaluation": hashlib.sha256(json.dumps([evaluation_windows(ctx), prompts]).encode()).hexdigest(),
           "kiln": __version__}
    path = answers_path(key, "activation-paths")
    try:
        cached = json.loads(path.read_text())
        return {m: choice.Speed(*s) for m, s in cached["speeds"].items()}, cached["figures"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    speeds, figures = {}, {}
    bar = progress(None, "choosing activations", "path", ctx.show_progress, total=len(modes))
    for mode in modes:
        speeds[mode] = choice.time_path(out, mode, kv_dtype, out.meta["model"]["vocab_size"])
        if not is_exact(out, ctx, mode):
            figures[mode] = evaluated(out, ctx, mode, requantized)
        if ctx.show_progress:
            bar.update(1)
    if ctx.show_progress:
        bar.close()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"speeds": {m: [s.decode_tok_s, s.prefill_tok_s] for m, s in speeds.items()},
                                   "figures": figures}))
        tmp.replace(path)
    except OSError:
        pass  # a cache that cannot be written costs the next build the measures, nothing else
    return speeds, figures
