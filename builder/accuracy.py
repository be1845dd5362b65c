"""Accuracy of a quantized graph against the unquantized model: perplexity, next-token KL, and the build gate.

Both graphs run over the same token windows of the evaluation text (builder/calibration.py):
perplexity = exp(mean negative log-likelihood of each window's tokens 2..n), and the KL figure is
the mean over those positions of KL(p_reference || p_quantized) in nats.
"""

from __future__ import annotations

import math

import torch

from builder.calibration import GraphRunner, progress
from builder.errors import KilnError
from builder.ir import Graph

ROWS = 128  # positions per float64 chunk of the [T, vocab] distributions


def reference_graph(model) -> Graph:
    """The model as traced, with float32 weights: what every quantized build is measured against."""
    from builder.trace import trace

    graph = trace(model)
    for name in graph.weights:
        graph.tensors[name] = model.load(name)
    return graph


def window_figures(reference: torch.Tensor, quantized: torch.Tensor, ids: list[int]) -> tuple[float, float, float]:
    """(sum NLL reference, sum NLL quantized, sum KL) over positions 0..n-2 predicting ids[1:]."""
    targets = torch.tensor(ids[1:])[:, None]
    nll_ref = nll_q = kl = 0.0
    for start in range(0, len(ids) - 1, ROWS):
        stop = min(start + ROWS, len(ids) - 1)
        log_p = torch.log_softmax(reference[start:stop].double(), dim=-1)
        log_q = torch.log_softmax(quantized[start:stop].double(), dim=-1)
        nll_ref -= float(log_p.gather(1, targets[start:stop]).sum())
        nll_q -= float(log_q.gather(1, targets[start:stop]).sum())
        kl += float((log_p.exp() * (log_p - log_q)).sum())
    return nll_ref, nll_q, kl


def evaluate(reference: Graph, quantized: Graph, windows: list[list[int]], kv_dtype: str = "f32",
             activations: str = "f32", show_progress: bool = False) -> dict:
    """Perplexity of both graphs and the mean KL over `windows`; the quantized one as the engine runs it
    (its KV cache rounding, and int8 activations if the plan asks for them)."""
    q_runner = GraphRunner(quantized, kv_dtype, activations)
    ref_runner = GraphRunner(reference) if reference is not quantized else None  # else: q_runner, run exactly
    nll_ref = nll_q = kl = 0.0
    tokens = 0
    for ids in progress(windows, "accuracy", "window", show_progress):
        ref = ref_runner.run(ids) if ref_runner else q_runner.run(ids, exact=True)
        r, q, k = window_figures(ref, q_runner.run(ids), ids)
        nll_ref, nll_q, kl, tokens = nll_ref + r, nll_q + q, kl + k, tokens + len(ids) - 1
    ppl_ref, ppl_q = math.exp(nll_ref / tokens), math.exp(nll_q / tokens)
    return {
        "evaluation_tokens": tokens,
        "ppl_reference": _round(ppl_ref),
        "ppl_quantized": _round(ppl_q),
        "ppl_increase_pct": _round(100 * (ppl_q / ppl_ref - 1)),
        "kl_mean": _round(kl / tokens),
    }


def check_gate(figures: dict, max_ppl_increase: float | None) -> None:
    """Fail the build (KilnError, one line with the figures) when perplexity rose by more than allowed."""
    if max_ppl_increase is None or figures["ppl_increase_pct"] <= max_ppl_increase:
        return
    raise KilnError(
        f"accuracy gate: {figures['method']} raised perplexity by {figures['ppl_increase_pct']:.3f}% "
        f"({figures['ppl_reference']:.4f} -> {figures['ppl_quantized']:.4f}, mean KL {figures['kl_mean']:.5f} nats "
        f"over {figures['evaluation_tokens']} tokens), above max_ppl_increase {max_ppl_increase:g}%; "
        "nothing was written (raise the limit, exclude layers, or pick a wider method)")


def _round(value: float) -> float:
    return float(f"{value:.7g}")
