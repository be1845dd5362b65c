"""Activation paths of the cpu kernels, and the one an engine runs with, chosen on the host that serves it.

An int4/int8 linear (or logits, or a mixture's expert) whose input width is a multiple of 32 can compute on f32
activations or quantize them per token and block of 32 to int16, int12 or int8; its node's `act` attribute says
which (absent: f32). The packed weights are the same for every path, so one engine can run any of them.

The build measures the accuracy of each path (greedy chat agreement, perplexity) and records which pass its gate
(manifest["activation_choice"]["allowed"]). Which of those is fastest depends on the CPU: a half-rate f32 unit
favours int16 as soon as steps batch tokens, a full-rate one may not. So at start-up the runtime times the allowed
paths here (`host_choice`): the program's linears at one token (a decode step of one sequence), 16 (a batched
decode step) and 64 (a prompt chunk), on this process's threads; the most precise path wins unless a coarser one
is MIN_GAIN faster by the geometric mean of the three. The result is kept in Kiln's cache per engine build, CPU
and thread count, so a host times an engine once. A path applies to the whole engine for its life: a request's
tokens never depend on which other requests share its steps (each token's activations are quantized alone).
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import statistics
import time
from dataclasses import dataclass

import torch

from runtime.format.cache import cache_path
from runtime.format.engine_format import EngineError, cpu_flags
from runtime.ops import linear
from runtime.weights import FORMATS

CANDIDATES = ("f32", "int16", "int12", "int8")  # the most precise first
INTEGER_ACTIVATIONS = CANDIDATES[1:]
MIN_GAIN = 1.05        # a coarser path must be this much faster (geometric mean) than the more precise one chosen
TIMED_TOKENS = (1, 16, 64)
TIMED_WEIGHTS = 48 << 20  # weights of the linears timed, at most (the first layers': the rest repeat them)
ROUNDS = 5


def integer_activations(op: str, attrs: dict, activations: str) -> bool:
    """The integer activation paths (int8, int16, int12) take int4/int8 linears (and logits) whose input
    width is a multiple of 32; other nodes compute on f32 activations."""
    quant = attrs.get("quant")
    return (activations in INTEGER_ACTIVATIONS and op in ("linear", "logits", "moe_linear") and quant in FORMATS
            and FORMATS[quant].integer_activations and attrs["in_features"] % 32 == 0)


def with_activations(doc: dict, activations: str) -> dict:
    """A packed program (JSON doc) whose int4/int8 linears, logits and experts compute with `activations` ("f32":
    all of them on f32 activations). Only their `act` key is the activation path: a silu_mul's or a moe's own
    `act` names its gated activation and stays."""

    def linear(op: str, attrs: dict) -> dict:
        attrs = {k: v for k, v in attrs.items() if k != "act"}
        return dict(attrs, act=activations) if integer_activations(op, attrs, activations) else attrs

    nodes = []
    for node in doc["nodes"]:
        if node["op"] in ("linear", "logits"):
            node = dict(node, attrs=linear(node["op"], node["attrs"]))
        elif node["op"] == "moe":
            entries = [linear("moe_linear", entry) for entry in node["attrs"]["linears"]]
            node = dict(node, attrs=dict(node["attrs"], linears=entries))
        nodes.append(node)
    return dict(doc, nodes=nodes)


def program_activations(doc: dict) -> str:
    """The path a packed program's linears run ("f32" when none takes an integer one)."""
    modes = {n["attrs"].get("act") for n in doc["nodes"] if n["op"] in ("linear", "logits")}
    return next((mode for mode in INTEGER_ACTIVATIONS if mode in modes), "f32")


def worth_timing(paths: list[str]) -> list[str]:
    """The paths that can differ in speed here: without AMX tiles int12 runs int16's instructions (int16 kept)."""
    return [m for m in paths if m != "int12" or "int16" not in paths or linear.isa() == "amx"]


def choose(scores: dict[str, float]) -> tuple[str, list[str]]:
    """(the chosen path, the faster paths passed over): from the most precise of `scores` (path -> speed relative
    to f32, higher is faster), each coarser path taken only if it is MIN_GAIN faster than the one taken so far."""
    order = sorted(scores, key=CANDIDATES.index)
    best, held = order[0], []
    for mode in order[1:]:
        if scores[mode] >= MIN_GAIN * scores[best]:
            best = mode
        elif scores[mode] > scores[best]:
            held.append(mode)
    return best, [m for m in held if scores[m] > scores[best]]


# ------------------------------------------------------------------------------------------ on the serving host

@dataclass(frozen=True)
class HostChoice:
    activations: str
    why: str
    scores: dict[str, float]  # path -> speed relative to f32 on this host (empty: not timed)
    cached: bool = False


def time_paths(doc: dict, tensors: dict[str, torch.Tensor], modes: list[str]) -> dict[str, float]:
    """Each path's speed relative to the first's: the geometric mean over TIMED_TOKENS of the time the program's
    first linears (up to TIMED_WEIGHTS of weights) take, on this process's threads."""
    nodes, weights = [], 0
    for node in doc["nodes"]:
        attrs = node["attrs"]
        if node["op"] == "linear" and any(integer_activations("linear", attrs, m) for m in modes):
            operands = linear.operands_of(node["inputs"], attrs, tensors)
            nodes.append((attrs, operands))
            weights += attrs["in_features"] * attrs["out_features"]
            if weights >= TIMED_WEIGHTS:
                break
    if not nodes:
        return {mode: 1.0 for mode in modes}
    generator = torch.Generator().manual_seed(0)
    seconds: dict[str, list[float]] = {}
    for mode in modes:
        bound = [(linear.bind_linear(with_activations({"nodes": [{"op": "linear", "attrs": attrs}]}, mode)["nodes"][0]
                                     ["attrs"], operands), attrs["in_features"]) for attrs, operands in nodes]
        for tokens in TIMED_TOKENS:
            inputs = {k: torch.randn(tokens, k, generator=generator) for _, k in bound}
            runs = []
            for _ in range(ROUNDS + 1):  # the first warms the kernels' workspaces
                started = time.perf_counter()
                for fn, k in bound:
                    fn(inputs[k])
                runs.append(time.perf_counter() - started)
            seconds.setdefault(mode, []).append(statistics.median(runs[1:]))
    base = seconds[modes[0]]
    return {mode: math.prod(b / s for b, s in zip(base, seconds[mode])) ** (1 / len(base)) for mode in modes}


def host_key(build_id: str, threads: int) -> dict:
    """What decides a host's timing of an engine: its build, this CPU and kernels, the thread count."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        model = ""
    return {"build_id": build_id, "cpu": model or platform.processor(), "flags": sorted(cpu_flags()),
            "isa": linear.isa(), "threads": threads}


def host_choice(build_id: str, allowed: list[str], built: str, load_program, requested: str | None = None,
                threads: int | None = None) -> HostChoice:
    """The path this host runs an engine with: `requested` (it must be one the build allowed), the only allowed
    one, or the fastest allowed one timed here (kept in Kiln's cache). load_program() -> (doc, tensors) of a rank.
    ValueError, in one line, for a path the build did not allow."""
    allowed = [m for m in CANDIDATES if m in allowed] or [built]
    if requested is not None:
        if requested not in allowed:
            raise ValueError(f"--activations {requested}: the build allowed {', '.join(allowed)} (its accuracy gate; "
                             "`engine-build inspect` shows the table); rebuild with --activations "
                             f"{requested} to run it")
        return HostChoice(requested, "asked for with --activations", {})
    if len(allowed) == 1:
        return HostChoice(allowed[0], "the one path the build allowed", {})
    allowed = worth_timing(allowed)
    threads = threads or torch.get_num_threads()
    path = cache_path("activations", host_key(build_id, threads))
    try:
        scores = {m: float(s) for m, s in json.loads(path.read_text())["scores"].items()}
        cached = set(scores) == set(allowed)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        cached = False
    if not cached:
        doc, tensors = load_program()
        scores = time_paths(doc, tensors, allowed)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"scores": scores}, sort_keys=True))
        except OSError:
            pass  # a cache that cannot be written costs the next start the timing, nothing else
    best, held = choose(scores)
    table = ", ".join(f"{m} x{scores[m]:.2f}" for m in allowed)
    why = (f"the fastest path the build allowed on this host, {threads} thread(s) ({table} of f32's linears "
           f"at {'/'.join(map(str, TIMED_TOKENS))} tokens)")
    if held:
        why += f"; {', '.join(held)} gained under x{MIN_GAIN:g}"
    return HostChoice(best, why, scores, cached)


def rebind(rank_file, activations: str):
    """A rank file (runtime.format.engine_format.RankFile) whose program runs `activations` (the same weights)."""
    doc = json.loads(rank_file.program)
    if program_activations(doc) == activations:
        return rank_file
    return type(rank_file)(json.dumps(with_activations(doc, activations)), rank_file.tensors)


def for_host(engine, backend, requested: str | None = None):
    """`engine` (an EngineDir) with the path this host runs it with, for a backend (a runtime/backends module) that
    takes activation paths (ACTIVATION_PATHS); as it is otherwise, where --activations is refused in one line."""
    manifest = engine.manifest
    if not backend.ACTIVATION_PATHS:
        if requested is not None:
            raise EngineError(f"--activations {requested}: the {backend.__name__.rsplit('.', 1)[-1]} backend "
                              "computes as the engine was built")
        return engine

    def load_program():
        rank_file = engine.load_rank(0)
        return json.loads(rank_file.program), rank_file.tensors

    try:
        choice = host_choice(manifest.build_id, list(manifest.activation_modes), manifest.activations, load_program,
                             requested)
    except ValueError as exc:
        raise EngineError(str(exc)) from None
    return dataclasses.replace(engine, activation_choice=choice)


def describe(engine) -> str | None:
    """One line on the path an open engine (an EngineDir) runs and why, where the build left a choice."""
    choice = engine.activation_choice
    if choice is None or len(engine.manifest.activation_modes) < 2:
        return None
    return f"activations: {choice.activations}: {choice.why}" + (" (timed before, cached)" if choice.cached else "")
