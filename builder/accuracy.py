"""Accuracy of a quantized graph against the unquantized model: perplexity, next-token KL, and the build gate.

Both graphs run over the same token windows of the evaluation text (builder/calibration.py):
perplexity = exp(mean negative log-likelihood of each window's tokens 2..n), and the KL figure is
the mean over those positions of KL(p_reference || p_quantized) in nats.

Greedy agreement is what a chat user sees: the reference answers each shipped chat prompt greedily
(GREEDY_TOKENS tokens, or up to its end-of-sequence token); the quantized graph then reads prompt +
answer in one pass, and its answer equals the reference's up to the first position whose argmax
differs. A prompt agrees when the whole answer does.
"""

from __future__ import annotations

import math

import torch

from builder.calibration import GraphRunner, progress
from builder.errors import KilnError
from builder.ir import Graph

ROWS = 128  # positions per float64 chunk of the [T, vocab] distributions
GREEDY_TOKENS = 32


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


def leading_agreement(expected: list[int], logits: torch.Tensor) -> int:
    """How many of `expected` a greedy decoder reproduces, from the logits of a pass over prompt +
    expected[:-1] whose last len(expected) rows predict them."""
    got = logits[-len(expected):].argmax(-1).tolist()
    return next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), len(expected))


def greedy_agreement(reference: GraphRunner, quantized: GraphRunner, prompts: list[list[int]], stop: set[int],
                     show_progress: bool = False) -> dict:
    """Share of prompts whose greedy answers are identical, and the mean identical leading tokens.
    When both runners are one (a graph that is not requantized), the reference runs exactly."""
    leading, lengths = [], []
    for ids in progress(prompts, "greedy agreement", "prompt", show_progress):
        expected = reference.generate(ids, GREEDY_TOKENS, stop, exact=reference is quantized)
        leading.append(leading_agreement(expected, quantized.run(ids + expected[:-1])))
        lengths.append(len(expected))
    return {
        "greedy_prompts": len(prompts),
        "greedy_tokens": GREEDY_TOKENS,
        "greedy_agreement_pct": _round(100 * sum(a == n for a, n in zip(leading, lengths)) / len(prompts)),
        "greedy_mean_leading": _round(sum(leading) / len(prompts)),
        "greedy_leading": leading,
    }


def evaluate(reference: Graph, quantized: Graph, windows: list[list[int]], kv_dtype: str = "f32",
             activations: str = "f32", show_progress: bool = False,
             prompts: list[list[int]] | None = None, stop: set[int] = frozenset()) -> dict:
    """Perplexity of both graphs and the mean KL over `windows`, and greedy agreement over `prompts`; the
    quantized one as the engine runs it (its KV cache rounding, and integer activations if the plan asks)."""
    q_runner = GraphRunner(quantized, kv_dtype, activations)
    ref_runner = GraphRunner(reference) if reference is not quantized else None  # else: q_runner, run exactly
    nll_ref = nll_q = kl = 0.0
    tokens = 0
    for ids in progress(windows, "accuracy", "window", show_progress):
        ref = ref_runner.run(ids) if ref_runner else q_runner.run(ids, exact=True)
        r, q, k = window_figures(ref, q_runner.run(ids), ids)
        nll_ref, nll_q, kl, tokens = nll_ref + r, nll_q + q, kl + k, tokens + len(ids) - 1
    ppl_ref, ppl_q = math.exp(nll_ref / tokens), math.exp(nll_q / tokens)
    figures = {
        "evaluation_tokens": tokens,
        "ppl_reference": _round(ppl_ref),
        "ppl_quantized": _round(ppl_q),
        "ppl_increase_pct": _round(100 * (ppl_q / ppl_ref - 1)),
        "kl_mean": _round(kl / tokens),
    }
    if prompts:
        figures.update(greedy_agreement(ref_runner or q_runner, q_runner, prompts, stop, show_progress))
    return figures


def check_gate(figures: dict, max_ppl_increase: float | None, min_greedy_agreement: float | None = None) -> None:
    """Fail the build (KilnError, one line with the figures) when perplexity rose by more than allowed or
    fewer greedy chat answers than required equal the reference's."""
    if min_greedy_agreement is not None and figures["greedy_agreement_pct"] < min_greedy_agreement:
        agreed = round(figures["greedy_agreement_pct"] * figures["greedy_prompts"] / 100)
        raise KilnError(
            f"accuracy gate: {figures['method']} weights with {figures['activations']} activations answer "
            f"{agreed} of {figures['greedy_prompts']} chat prompts as the reference does in their first "
            f"{figures['greedy_tokens']} greedy tokens ({figures['greedy_agreement_pct']:.1f}%, "
            f"{figures['greedy_mean_leading']:.1f} identical leading tokens on average), below min_greedy_agreement "
            f"{min_greedy_agreement:g}%; nothing was written (lower the limit, use wider activations, or exclude layers)")
    if max_ppl_increase is None or figures["ppl_increase_pct"] <= max_ppl_increase:
        return
    raise KilnError(
        f"accuracy gate: {figures['method']} raised perplexity by {figures['ppl_increase_pct']:.3f}% "
        f"({figures['ppl_reference']:.4f} -> {figures['ppl_quantized']:.4f}, mean KL {figures['kl_mean']:.5f} nats "
        f"over {figures['evaluation_tokens']} tokens), above max_ppl_increase {max_ppl_increase:g}%; "
        "nothing was written (raise the limit, exclude layers, or pick a wider method)")


def _round(value: float) -> float:
    return float(f"{value:.7g}")
