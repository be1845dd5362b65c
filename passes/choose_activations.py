"""Choose activations (analysis, cpu target, activations = "auto"): time each activation path of the quantized,
fused program on this host, measure the accuracy of those that round activations, and record the paths the gate
allows and the fastest of them here (builder/activation_choice.py) in graph.meta["activation_choice"], the one
built in graph.meta["activations"]. measure_accuracy reuses the built path's figures."""

from __future__ import annotations

import torch

from builder import activation_choice as choice
from builder.calibration import progress
from builder.ir import Graph
from passes.context import PassContext
from passes.measure_accuracy import evaluated, is_exact


# The figures of a path that loses nothing (not evaluated)
EXACT = {"greedy_agreement_pct": 100.0, "ppl_increase_pct": 0.0, "kl_mean": 0.0}


def choose_activations(graph: Graph, ctx: PassContext) -> Graph:
    out = graph.replace()
    quant, kv_dtype = ctx.plan.quant, ctx.plan.kv_cache.dtype
    modes = choice.candidates(out)
    requantized = out.meta.get("source_requantized", [])
    vocab = out.meta["model"]["vocab_size"]
    speeds, figures, rows = {}, {}, []
    bar = progress(None, "choosing activations", "path", ctx.show_progress, total=len(modes))
    for mode in modes:
        speeds[mode] = choice.time_path(out, mode, kv_dtype, vocab)
        if not is_exact(out, ctx, mode):
            figures[mode] = evaluated(out, ctx, mode, requantized)
        measured = figures.get(mode, EXACT)
        rows.append({"activations": mode, "decode_tok_s": round(speeds[mode].decode_tok_s, 1),
                     "prefill_tok_s": round(speeds[mode].prefill_tok_s, 1),
                     **{key: measured[key] for key in EXACT}, "exact": mode not in figures})
        if ctx.show_progress:
            bar.update(1)
    if ctx.show_progress:
        bar.close()
    allowed = choice.allowed({mode: figures.get(mode) for mode in modes}, quant.min_greedy_agreement,
                             quant.max_ppl_increase)
    chosen, why = choice.choose(speeds, allowed)
    f32 = figures.get("f32", EXACT)
    out.meta["activations"] = chosen
    out.meta["activation_choice"] = {
        "chosen": chosen, "why": why, "allowed": allowed,
        "gate_greedy_agreement_pct": (quant.min_greedy_agreement if quant.min_greedy_agreement is not None
                                      else f32["greedy_agreement_pct"]),
        "gate_ppl_increase_pct": (quant.max_ppl_increase if quant.max_ppl_increase is not None
                                  else round(f32["ppl_increase_pct"] + choice.PPL_MARGIN, 6)),
        "threads": torch.get_num_threads(), "prompt_tokens": choice.PROMPT_TOKENS,
        "decode_steps": choice.DECODE_STEPS, "rounds": choice.ROUNDS, "paths": rows}
    out.meta["activation_figures"] = {mode: f for mode, f in figures.items() if mode == chosen}
    return out
