"""activations = "auto" (cpu target): every activation path measured at build, the gate's choice of those an
engine may run, and the build host's pick among them.

Each candidate path (f32, int16, int12 and int8) is measured for accuracy the way every
lossy plan is (builder/measure/accuracy.py: perplexity, KL and greedy chat agreement; f32 on weights the build keeps
exactly is exact), and timed on this host with this build's threads: a prefill of PROMPT_TOKENS tokens, then
DECODE_STEPS single-sequence decode steps replayed from a tape as the engine serves them, ROUNDS times, medians
kept.

The gate (`allowed`): a path passes when its greedy agreement is f32's and its perplexity within PPL_MARGIN
percent of f32's (the plan's min_greedy_agreement and max_ppl_increase replace those bounds). The manifest
lists the paths that pass and the one fastest here, each coarser path taken only if it beats the one taken so
far by MIN_GAIN, speed being the geometric mean of decode and prefill speed relative to f32 (a path must not buy
one with the other). The engine is packed on f32 activations: at start-up the runtime times the allowed paths on
the host that serves it and runs the fastest there (runtime/backends/activations.py), so an engine built in CI on one CPU
runs the path that suits another.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch

from builder.measure.evaluation import BLOCK_SIZE, _rank_file
from builder.graph.ir import Graph
from runtime.backends import activations
from runtime.backends.activations import CANDIDATES, MIN_GAIN, integer_activations
from runtime.backends.cpu.executor import CpuExecutor
from runtime.backends.step import StepMetadata

PPL_MARGIN = 0.01     # percent of perplexity a path may add to f32's under the default gate
PROMPT_TOKENS = 128
DECODE_STEPS = 16
ROUNDS = 3
BLOCKS = math.ceil((PROMPT_TOKENS + DECODE_STEPS + 1) / BLOCK_SIZE)  # the KV cache the timing uses


@dataclass(frozen=True)
class Speed:
    decode_tok_s: float   # one sequence, after PROMPT_TOKENS tokens
    prefill_tok_s: float  # PROMPT_TOKENS tokens in one step


def candidates(graph: Graph) -> list[str]:
    """f32, and the integer paths some linear of the program can take (int12 too: its numbers are the same on every
    CPU, and a serving host with AMX tiles may run it faster than int16)."""
    return [mode for mode in CANDIDATES if mode == "f32" or any(integer_activations(n.op, n.attrs, mode)
                                                                   for n in graph.nodes)]


def _step(tokens: list[int], start: int) -> StepMetadata:
    """One sequence's step: `tokens` at positions start.., its slots the positions (blocks in order)."""
    count, end = len(tokens), start + len(tokens)
    return StepMetadata(
        token_ids=torch.tensor(tokens, dtype=torch.int64),
        positions=torch.arange(start, end, dtype=torch.int64),
        slot_mapping=torch.arange(start, end, dtype=torch.int64),
        block_tables=torch.arange(BLOCKS, dtype=torch.int32)[None, :],
        context_lens=torch.tensor([end], dtype=torch.int32),
        query_start_loc=torch.tensor([0, count], dtype=torch.int32),
        logits_indices=torch.tensor([count - 1], dtype=torch.int64))


def time_path(graph: Graph, activations: str, kv_dtype: str, vocab_size: int) -> Speed:
    """Decode and prefill speed of the program packed for `activations`, on this host's kernels and threads."""
    # serving=False: the build process keeps giving freed memory back (every path pays the same page faults)
    executor = CpuExecutor(_rank_file(graph, activations), BLOCKS, BLOCK_SIZE, kv_dtype, serving=False)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(min(100, vocab_size - 1), vocab_size, (PROMPT_TOKENS,), generator=generator).tolist()
    prefill, decode = [], []
    for _ in range(ROUNDS + 1):  # the first round warms the kernels and records the decode tape
        started = time.perf_counter()
        logits = executor.execute(_step(prompt, 0))
        prefill.append(time.perf_counter() - started)
        token = int(logits.argmax())
        steps = []
        for position in range(PROMPT_TOKENS, PROMPT_TOKENS + DECODE_STEPS):
            started = time.perf_counter()
            token = int(executor.execute(_step([token], position)).argmax())
            steps.append(time.perf_counter() - started)
        decode.append(statistics.median(steps[2:]))  # past the steps that record the tape
    return Speed(1 / statistics.median(decode[1:]), PROMPT_TOKENS / statistics.median(prefill[1:]))


def allowed(figures: dict[str, dict | None], min_agreement: float | None, max_ppl: float | None) -> list[str]:
    """The paths the build's gate allows, most precise first. figures: path -> its accuracy figures (None: exact).
    A path passes when its greedy agreement reaches min_agreement (default: f32's own, so that no shipped prompt
    is answered otherwise) and its perplexity rises by at most max_ppl percent (default: f32's + PPL_MARGIN). None
    passing: f32 alone."""
    def agreement(mode):
        return 100.0 if figures[mode] is None else figures[mode]["greedy_agreement_pct"]

    def ppl(mode):
        return 0.0 if figures[mode] is None else figures[mode]["ppl_increase_pct"]

    least = min_agreement if min_agreement is not None else agreement("f32") if "f32" in figures else 100.0
    most = max_ppl if max_ppl is not None else (ppl("f32") if "f32" in figures else 0.0) + PPL_MARGIN
    order = sorted(figures, key=CANDIDATES.index)
    return [m for m in order if agreement(m) >= least and ppl(m) <= most] or ["f32"]


def choose(speeds: dict[str, Speed], allowed: list[str]) -> tuple[str, str]:
    """(the path this host builds, why): the fastest allowed path by the geometric mean of decode and prefill
    speed relative to f32, each coarser one taken only if MIN_GAIN faster (runtime.backends.activations.choose)."""
    base = speeds["f32"]
    score = {m: math.sqrt(speeds[m].decode_tok_s / base.decode_tok_s * speeds[m].prefill_tok_s / base.prefill_tok_s)
             for m in activations.worth_timing(allowed)}
    best, held = activations.choose(score)
    if best == "f32" and held:
        fastest = max(held, key=score.get)
        why = (f"f32: {fastest}, the fastest path the gate allows, is only x{score[fastest]:.2f} of f32 (geometric "
               f"mean of decode and prefill speed), under the x{MIN_GAIN:g} a rounding path must gain")
    else:
        why = (f"{best}: x{score[best]:.2f} of f32 (geometric mean of decode and prefill speed), the fastest path "
               f"the gate allows by at least x{MIN_GAIN:g} over each more precise one")
        if held:
            why += "; " + ", ".join(f"{m} x{score[m]:.2f} gained too little over it" for m in held)
    refused = [m for m in speeds if m not in allowed]
    if refused:
        why += f"; the gate refused {', '.join(refused)}"
    return best, why
