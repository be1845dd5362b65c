"""Accuracy of a quantized graph against the unquantized model: perplexity, next-token KL, and the build gate.

Both graphs run over the same token windows of the evaluation text (builder/measure/calibration.py):
perplexity = exp(mean negative log-likelihood of each window's tokens 2..n), and the KL figure is
the mean over those positions of KL(p_reference || p_quantized) in nats.

Greedy agreement is what a chat user sees: the reference answers each shipped chat prompt greedily
(GREEDY_TOKENS tokens, or up to its end-of-sequence token); the quantized graph then reads prompt +
answer in one pass, and its answer equals the reference's up to the first position whose argmax
differs. A prompt agrees when the whole answer does.

Both run as Kiln's cpu engine runs them, batched (builder/measure/evaluation.py): the windows a few to a step, every
prompt's answer decoded together. A graph of at most STREAM_BYTES of weights is packed once and held; a larger one
runs a layer at a time (the float reference read from the source at each step, the quantized graph quantized and
packed once into a scratch folder and mapped from there), so the build holds neither whole model. The reference's
answers are kept in Kiln's cache by what decides them (the model's weights, the prompts, the kernels), so the
next build of the same model, with any plan, decodes none.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import json
import math
import os
import tempfile
from pathlib import Path

import torch

from builder.errors import KilnError
from builder.graph.ir import TORCH_DTYPES, Graph
from builder.graph.trace import trace
from builder.measure.calibration import progress
from builder.measure.evaluation import LayerRunner, Sequences, WholeRunner, forced_logits, greedy
from builder.planning.build_budget import freed_memory_given_back
from builder.sources.lazy_tensors import LazyTensors
from runtime import _native
from runtime.format.cache import cache_path

ROWS = 32  # positions per float64 chunk of the [T, vocab] distributions
GREEDY_TOKENS = 32
# A graph (the float reference, the quantized model) with more weight bytes than this runs a layer at a time
# (builder/measure/evaluation.py)
STREAM_BYTES = 1 << 30


def reference_graph(model) -> Graph:
    """The model as traced, with float32 weights read from the source when used: what every quantized build is
    measured against."""
    graph = trace(model)
    graph.tensors = LazyTensors({name: functools.partial(model.load, name) for name in graph.weights})
    return graph


def weight_bytes(graph: Graph) -> int:
    return sum(math.prod(w.shape) * TORCH_DTYPES[w.dtype].itemsize for w in graph.weights.values())


def window_figures(reference: torch.Tensor, quantized: torch.Tensor, targets: list[int]) -> tuple[float, float, float]:
    """(sum NLL reference, sum NLL quantized, sum KL) of logits rows predicting `targets` (one a row)."""
    targets = torch.tensor(targets)[:, None]
    nll_ref = nll_q = kl = 0.0
    for start in range(0, len(targets), ROWS):
        stop = min(start + ROWS, len(targets))
        log_p = torch.log_softmax(reference[start:stop].double(), dim=-1)
        log_q = torch.log_softmax(quantized[start:stop].double(), dim=-1)
        nll_ref -= float(log_p.gather(1, targets[start:stop]).sum())
        nll_q -= float(log_q.gather(1, targets[start:stop]).sum())
        kl += float((log_p.exp() * (log_p - log_q)).sum())
    return nll_ref, nll_q, kl


def leading_agreement(expected: list[int], tokens: torch.Tensor) -> int:
    """How many of `expected` a greedy decoder reproduces, from the argmax tokens of a pass over prompt +
    expected[:-1] whose last len(expected) rows predict them."""
    got = tokens[-len(expected):].tolist()
    return next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), len(expected))


def evaluate(reference: Graph, quantized: Graph, windows: list[list[int]], kv_dtype: str = "f32",
             activations: str = "f32", show_progress: bool = False,
             prompts: list[list[int]] | None = None, stop: set[int] = frozenset(), answers_key: dict | None = None
             ) -> dict:
    """Perplexity of both graphs and the mean KL over `windows`, and greedy agreement over `prompts`; the
    quantized one as the engine runs it (its KV cache rounding, and integer activations if the plan asks). When
    `reference` is `quantized` (a graph that is not requantized), the reference is that graph run exactly (f32
    activations and cache). answers_key: what decides the reference's answers, to keep them in Kiln's cache."""
    prompts = prompts or []  # the pool holds the windows, then (reused) every prompt with its answer
    blocks = max(Sequences([len(w) for w in windows]).blocks,
                 Sequences([len(p) + GREEDY_TOKENS for p in prompts]).blocks)
    streamed = {"reference": weight_bytes(reference) > STREAM_BYTES,
                "quantized": weight_bytes(quantized) > STREAM_BYTES}
    with tempfile.TemporaryDirectory(prefix="kiln-measure-") as scratch, \
            freed_memory_given_back(any(streamed.values())):
        return _evaluate(reference, quantized, windows, kv_dtype, activations, show_progress, prompts, stop,
                         answers_key, blocks, Path(scratch), streamed)


def _evaluate(reference, quantized, windows, kv_dtype, activations, show_progress, prompts, stop, answers_key,
              blocks: int, scratch: Path, streamed: dict[str, bool]) -> dict:
    if streamed["quantized"]:
        # spilled when its weights are derived (quantized, packed) at each read; float ones are read from the source
        derived = any(n.attrs.get("quant", "none") != "none" for n in quantized.nodes)
        q_runner = LayerRunner(quantized, blocks, kv_dtype, activations, spill=scratch if derived else None)
        shared = {name: q_runner.mapped(name) for name in q_runner.files or {}}
    else:
        q_runner = WholeRunner(quantized, blocks, kv_dtype, activations)
        shared = q_runner.rank_file.tensors
    if reference is quantized:
        ref_runner = q_runner.exact()
    else:
        same = None
        if hasattr(reference.tensors, "reads_as") and hasattr(quantized.tensors, "reads_as"):
            same = lambda name: reference.tensors.reads_as(name, quantized.tensors)  # noqa: E731
        ref_runner = (LayerRunner(reference, blocks, shared=_floats(shared, reference), same=same)
                      if streamed["reference"] else WholeRunner(reference, blocks))
    nll_ref = nll_q = kl = 0.0
    tokens = sum(len(w) - 1 for w in windows)
    bar = progress(None, "accuracy", "token", show_progress, total=tokens)
    for window in windows:
        rows = [list(range(len(window) - 1))]  # each position but the last predicts the next token
        # the reference's rows for the whole window first, in its own steps (a layer-at-a-time reference reads the
        # model once a step: few, large steps), then the quantized runner's, scored against them as they come
        pieces = [logits.clone() for _, _, (logits,) in forced_logits([ref_runner], [window], rows)]
        ref = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        del pieces
        for _, positions, (q,) in forced_logits([q_runner], [window], rows):
            r, q, k = window_figures(ref[positions[0]:positions[-1] + 1], q, [window[p + 1] for p in positions])
            nll_ref, nll_q, kl = nll_ref + r, nll_q + q, kl + k
            if show_progress:
                bar.update(len(positions))
        del ref
    if show_progress:
        bar.close()
    ppl_ref, ppl_q = math.exp(nll_ref / tokens), math.exp(nll_q / tokens)
    figures = {
        "evaluation_tokens": tokens,
        "ppl_reference": _round(ppl_ref),
        "ppl_quantized": _round(ppl_q),
        "ppl_increase_pct": _round(100 * (ppl_q / ppl_ref - 1)),
        "kl_mean": _round(kl / tokens),
    }
    if prompts:
        expected = reference_answers(ref_runner, prompts, stop, answers_key, show_progress)
        figures.update(greedy_agreement(q_runner, prompts, expected))
    del q_runner, ref_runner
    gc.collect()  # an executor's hooks refer back to it: free the runners' weights before the build goes on
    return figures


def _floats(shared: dict, reference: Graph) -> dict:
    """The quantized runner's tensors (or their readers) named like a float weight of the reference: those it may
    read instead of its source (LayerRunner checks their shapes and values)."""
    return {name: t for name, t in shared.items() if name in reference.weights}


def reference_answers(runner, prompts: list[list[int]], stop: set[int], key: dict | None,
                      show_progress: bool = False) -> list[list[int]]:
    """The reference's greedy answers to `prompts` (GREEDY_TOKENS tokens, or to its end-of-sequence token): from
    Kiln's cache when `key` names answers decoded before, else decoded all together (and kept, with a key)."""
    path = answers_path(dict(key, prompts=prompts, stop=sorted(stop), tokens=GREEDY_TOKENS)) if key else None
    if path is not None and path.is_file():
        try:
            cached = json.loads(path.read_text())
            if isinstance(cached, list) and len(cached) == len(prompts):
                return cached
        except (OSError, ValueError):
            pass  # unreadable: decode again and rewrite it
    bar = progress(None, "greedy reference", "token", show_progress, total=GREEDY_TOKENS)
    answers = greedy(runner, prompts, GREEDY_TOKENS, stop, on_step=bar.update if show_progress else None)
    if show_progress:
        bar.close()
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(answers))
            tmp.replace(path)
        except OSError:
            pass  # a cache that cannot be written costs the next build the decode, nothing else
    return answers


def answers_path(key: dict, kind: str = "reference-answers") -> Path:
    """Where Kiln's cache keeps what `key` decides with these kernels (the reference answers; `kind` names other
    figures) ($KILN_CACHE_DIR, else $XDG_CACHE_HOME/kiln or ~/.cache/kiln)."""
    return cache_path(kind, dict(key, kernels=kernels_digest()))


def kernels_digest() -> str:
    """sha256 of Kiln's compiled C kernels: other kernels may decode other answers."""
    digest = hashlib.sha256()
    for path in sorted(Path(_native.__file__).parent.glob("_*.so")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def greedy_agreement(quantized, prompts: list[list[int]], expected: list[list[int]]) -> dict:
    """Share of prompts whose greedy answers are identical, and the mean identical leading tokens: the quantized
    runner reads each prompt and the reference's answer (all of them batched) and is scored on the answer's rows."""
    sequences = [ids + answer[:-1] for ids, answer in zip(prompts, expected)]
    rows = [list(range(len(ids) - 1, len(s))) for ids, s in zip(prompts, sequences)]
    pieces: list[list[torch.Tensor]] = [[] for _ in prompts]
    for index, _, (logits,) in forced_logits([quantized], sequences, rows):
        pieces[index].append(logits.argmax(-1))
    leading = [leading_agreement(answer, torch.cat(p)) for answer, p in zip(expected, pieces)]
    lengths = [len(e) for e in expected]
    return {
        "greedy_prompts": len(prompts),
        "greedy_tokens": GREEDY_TOKENS,
        "greedy_agreement_pct": _round(100 * sum(a == n for a, n in zip(leading, lengths)) / len(prompts)),
        "greedy_mean_leading": _round(sum(leading) / len(prompts)),
        "greedy_leading": leading,
    }


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
