"""Choose activations (analysis, cpu target, activations = "auto"): time each activation path of the quantized,
fused program on this host, measure the accuracy of those that round activations, and record the fastest that
keeps the greedy gate (builder/activation_choice.py) in graph.meta["activations"], the table in
graph.meta["activation_choice"]. measure_accuracy reuses the chosen path's figures."""

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
    gate = quant.min_greedy_agreement if quant.min_greedy_agreement is not None else choice.DEFAULT_GATE
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
    agreement = {mode: figures[mode]["greedy_agreement_pct"] if mode in figures else None for mode in modes}
    chosen, why = choice.choose(speeds, agreement, gate)
    out.meta["activations"] = chosen
    out.meta["activation_choice"] = {
        "chosen": chosen, "why": why, "gate_greedy_agreement_pct": gate, "threads": torch.get_num_threads(),
        "prompt_tokens": choice.PROMPT_TOKENS, "decode_steps": choice.DECODE_STEPS, "rounds": choice.ROUNDS,
        "paths": rows}
    out.meta["activation_figures"] = {mode: f for mode, f in figures.items() if mode == chosen}
    return out
