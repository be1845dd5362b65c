"""What `engine-build plan` prints and writes: the ranked table, the summary and recommendation, the plan file
of a candidate, and the picture (--plot)."""

from __future__ import annotations

import json
from pathlib import Path

from builder.planning.build_budget import price_build
from builder.planning.planner import Candidate, Report, Workload
from builder.planning.shapes import WEIGHT_FORMATS, ModelShape, PlanningError
from builder.targets import target
from runtime.measure.bench import require_matplotlib


def plan_toml(c: Candidate, model: ModelShape, workload: Workload) -> str:
    """The candidate as a plan file for `engine-build build --plan`."""
    p = c.plan
    sizing = f"; {c.sizing['replicas']} replica(s) for {workload.users} users" if c.sizing else ""
    spread = f" over {c.nodes} hosts (`--nnodes {c.nodes}` at run time)" if c.nodes > 1 else ""
    lines = [f"# Written by `engine-build plan` for {model.name}: {c.device}, tp={c.tp}, pp={c.pp}{spread}, "
             f"{c.weights} weights, {c.kv_dtype} KV cache{sizing}.",
             f"# Per rank: weights {c.weight_gib:.2f} GiB, KV cache {c.kv_gib:.2f} GiB = {c.kv_tokens} tokens, "
             f"{c.sequences} sequences of {workload.context} tokens.",
             f'target = "{p.target}"', f'device = "{p.device}"', f"tp = {p.tp}", f"pp = {p.pp}",
             *([f"ep = {p.ep}"] if p.ep > 1 else []), "",
             "[limits]", f"max_batch_size = {p.limits.max_batch_size}",
             f"max_num_tokens = {p.limits.max_num_tokens}", f"max_seq_len = {p.limits.max_seq_len}", "",
             "[kv_cache]", f'dtype = "{p.kv_cache.dtype}"', f"block_size = {p.kv_cache.block_size}",
             f"memory_fraction = {p.kv_cache.memory_fraction}", "",
             "[quant]", f'method = "{p.quant.method}"', f"group_size = {p.quant.group_size}",
             f"exclude = {json.dumps(list(p.quant.exclude))}", f'activations = "{p.quant.activations}"']
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- output



def table_rows(report: Report, show_all: bool = False, limit: int = 12) -> tuple[list[str], list[list[str]]]:
    """Column titles and rows of the terminal table: the ranked candidates (the first `limit` that fit,
    then one line per device and format that does not), or every one with show_all."""
    sizing = report.workload.users is not None
    titles = ["#", "device", "tp", "pp", "weights", "kv", "weights/rank", "KV/rank", "KV tokens",
              f"seqs of {report.workload.context}", f"prefill {report.workload.input_tokens}", "tok/s b=1",
              "tok/s (batch)"]
    if sizing:  # the sizing columns instead of the single-replica speeds
        titles = titles[:8] + [titles[9], "batch", "ITL", "latency", "devices", "$/h", "$/1M tok"]
    titles.append("fits")
    rows, shown_misfits = [], set()
    fitting = 0
    for i, c in enumerate(report.candidates, 1):
        if not show_all:
            if c.fits:
                fitting += 1
                if fitting > limit:
                    continue
            elif (c.device, c.weights, c.kv_dtype) in shown_misfits:
                continue
            else:
                shown_misfits.add((c.device, c.weights, c.kv_dtype))
        top = max(c.decode) if c.decode else None
        row = [str(i), c.device.removeprefix("nvidia-"), str(c.tp), str(c.pp), c.weights, c.kv_dtype,
               _size(c.weight_gib), _size(c.kv_gib), f"{c.kv_tokens:,}", f"{c.sequences:,}",
               f"{c.prefill_s * 1e3:.0f} ms" if c.fits else "",
               f"{c.tokens_per_s(1):.0f}" if 1 in c.decode else "",
               f"{c.tokens_per_s(top):,.0f} ({top})" if top else ""]
        if sizing:
            row = row[:8] + [row[9]]
            z = c.sizing or {}
            if z.get("feasible"):
                row += [str(z["batch"]), f"{z['itl_s'] * 1e3:.1f} ms", f"{z['latency_s']:.2f} s", str(z["devices"]),
                        f"{z['usd_per_hour']:,.0f}" if "usd_per_hour" in z else "-",
                        f"{z['usd_per_million_tokens']:.3f}" if "usd_per_million_tokens" in z else "-"]
            else:
                row += ["", "", "", "", "", ""]
        row.append("yes" if c.fits and (not sizing or (c.sizing or {}).get("feasible")) else
                   ("misses the objectives" if c.fits else "no: " + _short_problem(c.problem)))
        rows.append(row)
    return titles, rows


def _size(gib: float) -> str:
    return f"{gib:.1f} GiB" if gib >= 1 else f"{gib * 1024:.0f} MiB"


def _short_problem(problem: str) -> str:
    """The part of a plan_memory message after the rank: what is short."""
    return problem.split(": ", 1)[-1].split(";")[0]


def summary_lines(report: Report) -> list[str]:
    m, w = report.model, report.workload
    lines = [f"model {m.name}: {m.parameters / 1e9:.2f} B parameters, {m.num_layers} layers, {m.num_heads} query / "
             f"{m.num_kv_heads} KV heads of {m.head_dim}; KV cache {m.kv_bytes_per_token('f16'):,} B a token in f16",
             *([f"mixture of experts: {m.num_experts} experts of {m.expert_intermediate_size}, {m.experts_per_token} a "
                f"token{', a shared expert' if m.shared_expert_intermediate_size else ''}: "
                f"{m.active_parameters / 1e9:.2f} B parameters read a token of {m.parameters / 1e9:.2f} B; tp ranks "
                "split the experts and all-reduce each mixture's output (hidden_size x 2 bytes a token)"]
               if m.num_experts else []),
             *([f"ranks spread over {report.nodes} hosts in order: tp groups or pipeline hand-overs that cross "
                f"hosts are priced at the devices' node link (plans/devices.toml node_link_*)"]
               if report.nodes > 1 else []),
             f"workload: {w.input_tokens}-token prompts, {w.output_tokens}-token answers"
             + (f", {w.users:,} concurrent users" if w.users else "")
             + "".join(f", {name} <= {value:g} s" for name, value in
                       (("latency p99", w.latency_s), ("TTFT", w.ttft_s), ("ITL", w.itl_s)) if value)]
    fitting = sum(c.fits for c in report.candidates)
    smallest: dict[tuple[str, str], Candidate] = {}
    for c in report.candidates:
        key = (c.device, c.weights)
        if c.fits and (key not in smallest or c.devices < smallest[key].devices):
            smallest[key] = c
    order = {w: i for i, w in enumerate(("source",) + WEIGHT_FORMATS)}
    for device in dict.fromkeys(c.device for c in report.candidates):
        fits = [f"{w} tp={c.tp}" + (f" pp={c.pp}" if c.pp > 1 else "")
                for (d, w), c in sorted(smallest.items(), key=lambda item: order.get(item[0][1], 9)) if d == device]
        misfit = sorted({c.weights for c in report.candidates if c.device == device} - {w for d, w in smallest if d == device})
        lines.append(f"{device}: fewest devices that fit: {', '.join(fits) or 'none'}"
                     + (f"; never fits: {', '.join(misfit)}" if misfit else ""))
    lines.append(f"{len(report.candidates)} candidates, {fitting} fit"
                 + (f"; {len(report.unbuildable)} plans refused as unbuildable (--json lists them)"
                    if report.unbuildable else ""))
    if w.users and any(c.sizing and c.sizing["feasible"] and "usd_per_hour" not in c.sizing for c in report.candidates):
        lines.append("ranked by cost where the catalog has a price; devices without one (--price DEVICE=USD) "
                     "follow, by device count")
    return lines


def recommendation_lines(report: Report) -> list[str]:
    best = report.recommended
    w = report.workload
    if best is None:
        return [no_candidate_message(report)]
    line = (f"recommended: {best.device} tp={best.tp} pp={best.pp}, {best.weights} weights, {best.kv_dtype} KV cache: "
            f"{_size(best.weight_gib)} of weights and {_size(best.kv_gib)} of KV cache a rank, "
            f"{best.sequences:,} sequences of {w.context} tokens")
    z = best.sizing
    if z:
        line += (f"; {z['replicas']} replica(s) x {best.devices} = {z['devices']} device(s) serve {w.users:,} users at "
                 f"batch {z['batch']} a stage, ITL {z['itl_s'] * 1e3:.1f} ms, latency {z['latency_s']:.2f} s")
        if "usd_per_hour" in z:
            line += f", ${z['usd_per_hour']:,.0f}/h, ${z['usd_per_million_tokens']:.3f} per million output tokens"
    return [line, build_line(report.model, best.plan)]


def build_line(model: ModelShape, plan) -> str:
    """What building the plan holds on the build host (builder/planning/build_budget.py)."""
    whole = price_build(model, plan)
    line = f"build: {whole.describe()} on the build host"
    if plan.world_size > 1 and target(plan.target).RANKS_ALONE:
        line += f"; each of ranks 1 to {plan.world_size - 1} built alone (--rank) {price_build(model, plan, 1).describe()}"
    return line


def no_candidate_message(report: Report) -> str:
    """What would make a workload servable when no candidate can."""
    w = report.workload
    if not any(c.fits for c in report.candidates):
        return ("no candidate fits: allow more devices (--tp, --pp), a smaller KV dtype (--kv-dtype fp8 or int8 where "
                "the target takes it), quantized weights (--weights int4 or fp8), or shorter prompts and answers")
    return (f"no candidate meets the objectives for {w.users:,} users at {w.input_tokens}+{w.output_tokens} tokens: "
            f"loosen the latency objectives, allow larger tensor parallelism (faster steps) or faster devices")


def plot(report: Report, path: Path, count: int = 6) -> None:
    """PNG: memory per rank of the top candidates (weights, workspace, KV cache) and their decode
    tokens/s against batch size."""
    try:
        plt = require_matplotlib()
    except ValueError as exc:
        raise PlanningError(str(exc)) from None  # the message names --plot and the extra
    shown = [c for c in report.candidates if c.fits][:count]
    if not shown:
        raise PlanningError("--plot: no candidate fits, nothing to draw")
    labels = [f"{c.device.replace('nvidia-', '')}\ntp{c.tp} pp{c.pp} {c.weights}" for c in shown]
    fig, (mem, tput) = plt.subplots(1, 2, figsize=(13, 5))
    bottom = [0.0] * len(shown)
    for name, values, color in (("weights", [c.weight_gib for c in shown], "#4c72b0"),
                                ("workspace", [c.workspace_gib for c in shown], "#dd8452"),
                                ("KV cache", [c.kv_gib for c in shown], "#55a868")):
        mem.bar(labels, values, bottom=bottom, label=name, color=color)
        bottom = [b + v for b, v in zip(bottom, values)]
    mem.set_ylabel("GiB per rank (the fullest rank)")
    mem.set_title(f"{report.model.name}: memory per rank")
    mem.set_ylim(0, max(bottom) * 1.2)  # room for the legend above the bars
    mem.legend(ncol=3, loc="upper center")
    mem.tick_params(axis="x", labelsize=8)
    for c, label in zip(shown, labels):
        batches = sorted(c.decode)
        tput.plot(batches, [c.tokens_per_s(b) for b in batches], marker="o", label=label.replace("\n", " "))
    tput.set_xscale("log", base=2)
    tput.set_yscale("log")
    tput.set_xlabel("sequences per step (batch)")
    tput.set_ylabel("decode tokens/s per replica (estimate)")
    tput.set_title(f"decode at {report.workload.input_tokens}+{report.workload.output_tokens} tokens")
    tput.legend(fontsize=7)
    tput.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
