"""activations = "auto" (cpu target): the activation path chosen by measurement on the build host.

Each candidate path (f32, int16, int8, and int12 where the kernels have AMX tiles: elsewhere it runs
int16's instructions, so it could only be int16 with coarser steps) runs the quantized, fused program
on this host, with this build's threads: a prefill of PROMPT_TOKENS tokens, then DECODE_STEPS
single-sequence decode steps replayed from a tape as the engine serves them, ROUNDS times, medians
kept. A path that rounds activations is also measured for accuracy the way every lossy plan is
(builder/accuracy.py: perplexity, KL and greedy chat agreement); f32 on weights the build keeps exactly
is exact.

The choice: among the paths whose greedy agreement reaches the gate (the plan's min_greedy_agreement, else
DEFAULT_GATE), from the most precise (f32, int16, int12, int8), each coarser path is taken only if it
beats the one taken so far by MIN_GAIN, where speed is the geometric mean of decode and prefill speed
relative to f32 (a path must not buy one with the other). Within that margin the timings are noise and
the more precise path wins the tie, so that a host where the paths run alike does not flip between
builds. The report and the manifest show the table and the reason.

A choice by timing depends on the host it was made on: the engine's bytes follow the choice, and the
manifest says which was made and why; pin `activations` for an engine built the same anywhere.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch

from builder.evaluation import BLOCK_SIZE, _rank_file
from builder.ir import Graph
from builder.packing import integer_activations
from runtime.executor import CpuExecutor
from runtime.ops import linear
from runtime.step import StepMetadata

CANDIDATES = ("f32", "int16", "int12", "int8")  # the most precise first
DEFAULT_GATE = 95.0   # percent of the shipped chat prompts answered as the reference does
MIN_GAIN = 1.05       # a coarser path must be this much faster (geometric mean) than the more precise one chosen
PROMPT_TOKENS = 128
DECODE_STEPS = 16
ROUNDS = 3
BLOCKS = math.ceil((PROMPT_TOKENS + DECODE_STEPS + 1) / BLOCK_SIZE)  # the KV cache the timing uses


@dataclass(frozen=True)
class Speed:
    decode_tok_s: float   # one sequence, after PROMPT_TOKENS tokens
    prefill_tok_s: float  # PROMPT_TOKENS tokens in one step


def candidates(graph: Graph) -> list[str]:
    """f32, and the integer paths when some linear of the program can take them (int12 only on AMX kernels)."""
    return [mode for mode in CANDIDATES if mode == "f32" or (
        (mode != "int12" or linear.isa() == "amx") and any(integer_activations(n.op, n.attrs, mode) for n in graph.nodes))]


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


def choose(speeds: dict[str, Speed], agreement: dict[str, float | None], gate: float) -> tuple[str, str]:
    """(the chosen path, why): from the most precise path whose greedy agreement (None: exact) reaches the
    gate, each coarser passing path that gains MIN_GAIN over the one chosen so far."""
    base = speeds["f32"]

    def score(mode: str) -> float:
        s = speeds[mode]
        return math.sqrt(s.decode_tok_s / base.decode_tok_s * s.prefill_tok_s / base.prefill_tok_s)

    order = sorted(speeds, key=lambda m: CANDIDATES.index(m) if m in CANDIDATES else len(CANDIDATES))
    passing = [m for m in order if agreement.get(m) is None or agreement[m] >= gate]
    if not passing:
        return "f32", f"no path answers at least {gate:g}% of the chat prompts as the reference does: f32"
    best, held = passing[0], []  # held: faster paths that did not gain MIN_GAIN over the path chosen before them
    for mode in passing[1:]:
        if score(mode) >= MIN_GAIN * score(best):
            best = mode
        elif score(mode) > score(best):
            held.append(mode)
    failed = [m for m in speeds if m not in passing]
    if best == "f32" and held:
        fastest = max(held, key=score)
        why = (f"f32: {fastest}, the fastest of the paths whose greedy agreement reaches {gate:g}%, is only "
               f"x{score(fastest):.2f} of f32 (geometric mean of decode and prefill speed), under the x{MIN_GAIN:g} "
               f"a rounding path must gain")
    else:
        why = (f"{best}: x{score(best):.2f} of f32 (geometric mean of decode and prefill speed), the fastest of "
               f"the paths whose greedy agreement reaches {gate:g}% by at least x{MIN_GAIN:g} over each more "
               f"precise one")
        held = [m for m in held if score(m) > score(best)]
        if held:
            why += "; " + ", ".join(f"{m} x{score(m):.2f} gained too little over it" for m in held)
    if failed:
        why += "; " + ", ".join(f"{m} answered {agreement[m]:.1f}%" for m in failed)
    return best, why
