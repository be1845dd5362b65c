"""`engine-run bench`: offline throughput and latency of an engine at chosen concurrencies.

Each level keeps `concurrency` synthetic requests in flight (a closed loop: a finished request is
replaced by the next) until `requests` have finished, every request with the same prompt and output
length (`ignore_eos`, greedy). Per level: output tokens/s, prefill tokens/s, time to first token and
inter-token latency percentiles, steps/s, and the weight bandwidth that implies (every step reads
all of a rank's weights once), tokens per step and the linear layers' operations per second. With
the machine's measured peaks (runtime/measure/roofline.py), each level also says what share of the read
bandwidth and of the compute peak it uses, and which of the two limits it.

With `busy_cores`, the levels run again while that many busy-loop processes are pinned to this
process's last CPUs (`BusyCores`), and a second table shows each level's share of its quiet speed:
how far the engine slows down when another process takes cores.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from runtime.core.engine import LLMEngine
from runtime.core.sampling import SamplingParams
from runtime.measure.roofline import Peaks, roofline
from runtime.ops.moe import ExpertReads


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    prompt_len: int
    output_len: int
    elapsed_s: float
    steps: int
    output_tok_s: float
    prefill_tok_s: float     # prompt tokens / the time of the steps that carried prompt tokens
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    weight_gbs: float        # steps/s x the largest rank's weight bytes
    tokens_per_step: float   # prompt and decode tokens a step carries, on average
    gops: float              # the linears' operations per second on one rank (2 per weight and token)
    memory_pct: float = math.nan   # weight_gbs against the measured read bandwidth
    compute_pct: float = math.nan  # gops against the measured peak of the engine's activations
    limit: str = ""                # "memory", "f32" or "int8": the larger share
    spec_acceptance_pct: float = math.nan  # speculative guesses that stood (NaN: no speculation)
    spec_tokens_per_step: float = math.nan  # tokens a speculating sequence gained per step

    COLUMNS = (("concurrency", "conc", "{:d}"), ("output_tok_s", "out tok/s", "{:.1f}"),
               ("prefill_tok_s", "prefill tok/s", "{:.0f}"), ("ttft_p50_ms", "TTFT p50 ms", "{:.1f}"),
               ("ttft_p99_ms", "TTFT p99 ms", "{:.1f}"), ("itl_p50_ms", "ITL p50 ms", "{:.1f}"),
               ("itl_p99_ms", "ITL p99 ms", "{:.1f}"), ("tokens_per_step", "tok/step", "{:.1f}"),
               ("weight_gbs", "weights GB/s", "{:.2f}"), ("memory_pct", "% read BW", "{:.0f}"),
               ("gops", "GOP/s", "{:.1f}"), ("compute_pct", "% compute", "{:.0f}"), ("limit", "limit", "{}"),
               ("spec_acceptance_pct", "spec accept %", "{:.0f}"), ("spec_tokens_per_step", "spec tok/step", "{:.2f}"))


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile by nearest rank (NaN for no values)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def synthetic_prompts(n: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """n prompts of `length` random token ids (ids below 100 are left out: special tokens live there)."""
    generator = torch.Generator().manual_seed(seed)
    low = min(100, vocab_size - 1)
    return [torch.randint(low, vocab_size, (length,), generator=generator).tolist() for _ in range(n)]


def weight_bytes(engine_dir: Path) -> int:
    """The largest rank's weight bytes from the build's memory plan: what one step reads per rank."""
    doc = json.loads((Path(engine_dir) / "manifest.json").read_text())
    return max(r["weight_bytes"] for r in doc["memory"]["ranks"])


class StepReads:
    """The weight bytes a level's steps read on the largest rank: every weight each step, but of a mixture of
    experts only the experts its tokens chose. A one-process engine on the cpu backend counts those as its moe
    kernel reads them (runtime.ops.moe.ExpertReads); elsewhere they are estimated as uniform routing would choose
    them: 1 - (1 - k/E)^tokens of each layer's experts for a step of `tokens` tokens (k/E at batch-1 decode)."""

    def __init__(self, engine_dir: Path):
        doc = json.loads((Path(engine_dir) / "manifest.json").read_text())
        rank = max(doc["memory"]["ranks"], key=lambda r: r["weight_bytes"])
        config = doc.get("model", {}).get("config", {})
        self.weights, self.experts = rank["weight_bytes"], rank.get("expert_bytes", 0)
        self.unchosen = 1 - config["experts_per_token"] / config["num_experts"] if self.experts else 0.0
        self.counted = 0

    def start(self) -> None:
        self.counted = ExpertReads.bytes

    def per_step(self, steps: int, tokens_per_step: float) -> float:
        """Mean bytes a step read over the `steps` steps since start()."""
        if not self.experts:
            return self.weights
        dense = self.weights - self.experts
        counted = ExpertReads.bytes - self.counted
        if counted:
            return dense + counted / steps
        return self.weights - self.experts * self.unchosen ** max(tokens_per_step, 1)


def run_level(llm: LLMEngine, concurrency: int, requests: int, prompt_len: int, output_len: int,
              weights, seed: int = 0, linear_params: tuple[int, int] = (0, 0)) -> LevelResult:
    """One level: `requests` requests, `concurrency` of them in flight at a time. `weights`: the bytes a step reads
    (an int, or a StepReads). `linear_params`: one rank's (layer, logits) linear parameters
    (runtime.measure.roofline.linear_parameters / world size)."""
    prefix = list(llm.special_tokens.prefix)  # a raw prompt of this model starts with it (BOS)
    prompts = [prefix + ids[len(prefix):] for ids in
               synthetic_prompts(requests, prompt_len, llm.engine.manifest.vocab_size, seed)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    pending = list(reversed(prompts))
    arrival: dict[str, float] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    gaps: list[float] = []
    seen: dict[str, int] = {}
    steps = 0
    prefill_time = 0.0
    spec_before = llm.stats()

    def submit() -> None:
        arrival[llm.add_request(pending.pop(), params)] = time.perf_counter()

    if isinstance(weights, StepReads):
        weights.start()
    start = time.perf_counter()
    for _ in range(min(concurrency, requests)):
        submit()
    while llm.has_unfinished():
        before = time.perf_counter()
        waiting = len(first) < len(arrival)
        outputs = llm.step()
        now = time.perf_counter()
        steps += 1
        if waiting:  # a step that carried prompt tokens (with any decodes beside them)
            prefill_time += now - before
        for out in outputs:
            rid = out.request_id
            if rid not in first:
                first[rid] = now
            elif len(out.token_ids) > seen[rid]:  # a speculative step may bring several tokens: each its share
                new = len(out.token_ids) - seen[rid]
                gaps.extend([(now - last[rid]) / new] * new)
            last[rid] = now
            seen[rid] = len(out.token_ids)
            if out.finished:
                if out.finish_reason == "error":
                    raise RuntimeError(f"request failed during the benchmark: {out.error}")
                if pending:
                    submit()
    elapsed = time.perf_counter() - start
    ttft = [first[r] - arrival[r] for r in arrival]
    spec = llm.stats()
    proposed = spec.spec_proposed_tokens - spec_before.spec_proposed_tokens
    spec_steps = spec.spec_steps - spec_before.spec_steps
    tokens_per_step = requests * (prompt_len + output_len - 1) / steps
    return LevelResult(
        concurrency=concurrency, requests=requests, prompt_len=prompt_len, output_len=output_len,
        elapsed_s=elapsed, steps=steps, output_tok_s=requests * output_len / elapsed,
        prefill_tok_s=requests * prompt_len / prefill_time if prefill_time else math.nan,
        ttft_p50_ms=1e3 * percentile(ttft, 50), ttft_p99_ms=1e3 * percentile(ttft, 99),
        itl_p50_ms=1e3 * percentile(gaps, 50), itl_p99_ms=1e3 * percentile(gaps, 99),
        weight_gbs=steps / elapsed * (weights.per_step(steps, tokens_per_step) if isinstance(weights, StepReads)
                                      else weights) / 1e9,
        # every prompt token and every output token but the last passes the layers; outputs need logits
        tokens_per_step=tokens_per_step,
        gops=2 * requests * (linear_params[0] * (prompt_len + output_len - 1) + linear_params[1] * output_len)
        / elapsed / 1e9,
        spec_acceptance_pct=(100 * (spec.spec_accepted_tokens - spec_before.spec_accepted_tokens) / proposed
                             if proposed else math.nan),
        spec_tokens_per_step=((spec.spec_emitted_tokens - spec_before.spec_emitted_tokens) / spec_steps
                              if spec_steps else math.nan))


def annotate(results: list[LevelResult], peaks: Peaks, activations: str) -> None:
    """Fill each level's shares of the measured peaks and the limit that applies."""
    for r in results:
        memory, compute, r.limit = roofline(r.weight_gbs, r.gops, peaks, activations)
        r.memory_pct, r.compute_pct = 100 * memory, 100 * compute


def _cell(fmt: str, value) -> str:
    """A table cell; a figure not measured (NaN, or an empty limit) shows as '-'."""
    missing = value == "" or (isinstance(value, float) and math.isnan(value))
    return "-" if missing else fmt.format(value)


def _aligned(header, rows) -> str:
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


SPEC_COLUMNS = ("spec_acceptance_pct", "spec_tokens_per_step")


def table(results: list[LevelResult]) -> str:
    """The levels as aligned columns; the speculative ones only when some level speculated."""
    speculated = any(not math.isnan(r.spec_acceptance_pct) for r in results)
    columns = [c for c in LevelResult.COLUMNS if speculated or c[0] not in SPEC_COLUMNS]
    header = [title for _, title, _ in columns]
    return _aligned(header, [[_cell(fmt, getattr(r, key)) for key, _, fmt in columns] for r in results])


def to_json(results: list[LevelResult], context: dict, busy: list[LevelResult] = ()) -> str:
    doc = {**context, "levels": [asdict(r) for r in results]}
    if busy:
        doc["busy_levels"] = [asdict(r) for r in busy]
    return json.dumps(doc, indent=2)


def require_matplotlib():
    """matplotlib's pyplot on a file-only backend, or a ValueError naming the extra that installs it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install -e \".[bench]\" (or pip install matplotlib)") from None
    return plt


def plot(results: list[LevelResult], path: Path, title: str) -> None:
    """Throughput and latency against concurrency, as a PNG (matplotlib, the bench extra)."""
    plt = require_matplotlib()
    from matplotlib.ticker import NullFormatter, NullLocator, ScalarFormatter
    levels = [r.concurrency for r in results]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(levels, [r.output_tok_s for r in results], "o-")
    left.set(xlabel="concurrent requests", ylabel="output tokens/s", title="throughput", xscale="log")
    for key, label in (("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99"),
                       ("itl_p50_ms", "ITL p50"), ("itl_p99_ms", "ITL p99")):
        right.plot(levels, [getattr(r, key) for r in results], "o-", label=label)
    right.set(xlabel="concurrent requests", ylabel="ms", title="latency", xscale="log", yscale="log")
    right.yaxis.set_major_formatter(ScalarFormatter())
    right.yaxis.set_minor_formatter(NullFormatter())
    right.legend()
    left.set_ylim(bottom=0)
    for axis in (left, right):
        axis.xaxis.set_minor_locator(NullLocator())
        axis.set_xticks(levels, [str(c) for c in levels])
        axis.grid(True, alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


class BusyCores:
    """`count` processes that spin on one CPU each, the last CPUs of this process's affinity mask,
    while the `with` block runs: someone else's work on the cores the engine runs on."""

    def __init__(self, count: int):
        cpus = sorted(os.sched_getaffinity(0))
        if not 0 < count <= len(cpus):
            raise ValueError(f"--busy-cores {count}: this process may use {len(cpus)} CPUs ({cpus}); "
                             f"give 1 to {len(cpus)}")
        self.cpus = cpus[-count:]
        self.processes: list[subprocess.Popen] = []

    def __enter__(self) -> BusyCores:
        for cpu in self.cpus:
            self.processes.append(subprocess.Popen(
                [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(0.5)  # they are spinning before the first request
        for process in self.processes:
            if process.poll() is not None:
                self.__exit__(None, None, None)
                raise RuntimeError(f"a busy-loop process exited at once (status {process.returncode})")
        return self

    def __exit__(self, *_) -> None:
        for process in self.processes:
            process.kill()
        for process in self.processes:
            process.wait()
        self.processes.clear()


def slowdown_table(quiet: list[LevelResult], busy: list[LevelResult]) -> str:
    """Per level: output tokens/s quiet and busy, the busy share of the quiet speed, and ITL p50 both ways."""
    header = ("conc", "quiet tok/s", "busy tok/s", "busy/quiet", "quiet ITL p50 ms", "busy ITL p50 ms")
    rows = [(f"{q.concurrency:d}", f"{q.output_tok_s:.1f}", f"{b.output_tok_s:.1f}",
             f"{100 * b.output_tok_s / q.output_tok_s:.0f}%" if q.output_tok_s > 0 else "-",
             _cell("{:.1f}", q.itl_p50_ms), _cell("{:.1f}", b.itl_p50_ms)) for q, b in zip(quiet, busy)]
    return _aligned(header, rows)
