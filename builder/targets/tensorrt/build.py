"""The tensorrt target's emission: per-rank ONNX, the checks that need no GPU, and TensorRT engines.

For every rank: lower the program to ONNX segments (builder/targets/tensorrt/lower_onnx.py), check each with
onnx.checker (shape inference included) and lint it against the ONNX operators the chosen TensorRT
parser supports (builder/targets/tensorrt/onnx_lint.py). Then verify every rank under ONNX Runtime against Kiln's cpu
engine of the same quantized program (builder/targets/tensorrt/verify_onnx.py); compile the PagedAttention
plugin's kernels with Triton for the plan's GPU (`kernels/`) and the plugin library with g++ (`plugins/`); and
compile each rank with TensorRT (builder/targets/tensorrt/compile.py) into one engine, `rank{r}.engine`: a Kiln
rank file holding the serialized engine, whose program is the engine between a pipeline stage's recv and send.
TensorRT's activation memory for each engine must fit the memory plan's workspace. A failing check stops the
build; nothing is written.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import onnx
import torch

from builder.emit import render_report
from builder.errors import KilnError
from builder.graph.ir import Graph
from builder.planning.plan import Plan, load_devices
from builder.targets.cuda import ARCHES
from builder.targets.cuda.compile import compile_variant, find_triton
from builder.targets.tensorrt.compile import RTX_TARGETS, CompiledRank, Profile, Toolchain, compile_rank, find_toolchain
from builder.targets.tensorrt.lower_onnx import PROGRAM_FILE, lower_rank
from builder.targets.tensorrt.onnx_attention import DOMAIN, OP, PLUGIN_VERSION
from builder.targets.tensorrt.onnx_lint import lint_model, load_op_table
from builder.targets.tensorrt.plugin_kernels import sampler_kernels
from builder.targets.tensorrt.verify_onnx import cpu_reference, verify_ranks
from passes.plan_memory import memory_record, rank_memory
from runtime.backends import check_files
from runtime.backends.cuda.kernel_index import INDEX, write_index
from runtime.format.engine_format import GIB, EngineError, Manifest, sha256_file, write_rank_file
from runtime.format.memory_plan import RankMemoryPlan
from runtime.trt_plugin import LIBRARY, PluginError, build_library, source_digest

# |logit difference| a build accepts against the cpu engine: f32 activations compute the same math
# in another order; f16/bf16 activations round every activation (then: share of the largest logit).
# A half-precision KV cache adds its own: a key or value that lands on the other side of a rounding
# boundary in one of them is one f16 step (2^-11 relative) apart, and later layers carry that on.
# On a tiny Llama with int4 weights, f32 activations and an f16 cache the largest difference was
# 3e-4 of the largest logit; with an f32 cache, 1e-6.
F32_TOLERANCE = 1e-3
HALF_TOLERANCE = 0.05
HALF_KV_TOLERANCE = 0.005
# FP8 rounding (an fp8 plan's activations, an fp8 KV cache): e4m3 keeps three mantissa bits, so a value an ulp
# from a rounding boundary in one engine lands on the neighbouring code in the other, 1/8 of its value apart, and
# each such flip moves what later layers compute, which makes more of them. Measured on SmolLM2-135M (largest
# logit 30.3; the tiny test Llama stays within 1e-4): an fp8 cache with f32 activations 0.54 (1.8%); fp8 weights
# and activations 2.74 (9%), 3.56 (12%) with an fp8 cache; with f16 activations 3.6 (12%) and 6.12 (20%). The
# two engines' cache codes were equal but for one of 4,608 in layer 0 and 14% apart in layer 29: rounding
# cascading, not a lowering fault. Such builds are held to a share of the largest logit only (the verification's
# rows are random tokens, whose top logits lie close: SmolLM2's fp8 plan kept the top-1 token on 7 of 10); the
# lowering's fp8 arithmetic is held exactly on its own (tests/unit/test_onnx_fp8_pool.py) and to 1e-4 on the
# tiny Llama (tests/e2e/test_onnx_parity.py, test_tensorrt.py).
FP8_TOLERANCE = 0.25


@dataclass
class TensorRTBuild:
    """What the tensorrt target needs besides the rank graphs."""

    plan: Plan
    whole: Graph               # the quantized program before sharding: the verification's reference
    onnx_only: bool
    vocab_size: int
    echo: Callable[[str], None] = print

    def toolchain(self) -> Toolchain | None:
        """The TensorRT that compiles this plan (a one-line KilnError when none installed can)."""
        return None if self.onnx_only else find_toolchain(self.compute_capability)

    @property
    def compute_capability(self) -> str:
        return load_devices()[self.plan.device].compute_capability

    def write_ranks(self, tmp: Path, graphs: list[Graph]) -> tuple[list[dict], dict]:
        plan, cc = self.plan, self.compute_capability
        chain = self.toolchain()
        table = load_op_table(*(chain.record().values() if chain else _expected_parser(cc)))
        ranks, lowered, export_seconds = [], [], []
        for rank, graph in enumerate(graphs):
            started = time.perf_counter()
            result = lower_rank(graph, tmp / "onnx" / f"rank{rank}", activations=plan.quant.activations,
                                kv_dtype=plan.kv_cache.dtype, block_size=plan.kv_cache.block_size,
                                max_seq_len=plan.limits.max_seq_len)
            export_seconds.append(time.perf_counter() - started)
            _check(result.directory, result.program, table, rank)
            lowered.append(result)
        record = self._verify(lowered)
        kernels = write_kernels(tmp, lowered, cc, self.vocab_size if plan.world_size == 1 else None)
        plugin = write_plugin(tmp)
        compile_record = {"compiled": False}
        for rank, result in enumerate(lowered):
            onnx_files = {name: sha256_file(result.directory / name) for name in result.files}
            entry = {"rank": rank, "file": None, "bytes": 0, "sha256": None,
                     "onnx": {"dir": f"onnx/rank{rank}", "files": onnx_files,
                              "bytes": sum((result.directory / n).stat().st_size for n in result.files),
                              "export_seconds": round(export_seconds[rank], 2)},
                     "io": _io_contract(result.program)}
            ranks.append(entry)
        if chain is not None:
            compile_record.update(self._compile(tmp, lowered, chain, ranks, graphs, plugin))
        target = manifest_target(plan)
        if chain is not None:
            target["tensorrt"] = chain.record()
        extras = {"target": target, "verification": record, "tensorrt": {
            **compile_record,
            "plugins": [{"name": OP, "namespace": DOMAIN, "version": PLUGIN_VERSION, "registered": chain is not None,
                         "library": plugin["file"], "sha256": plugin["sha256"],
                         "kernels": "runtime/backends/cuda/kernels: rope, kv_write, paged_attention"}],
            "kernels": kernels,
            "lint": f"{table.label}: no problems",
        }}
        return ranks, extras

    def _verify(self, lowered) -> dict:
        """Every rank under ONNX Runtime against the cpu engine; a KilnError above the tolerance."""
        plan = self.plan
        if plan.quant.activations == "bf16":  # nothing to run it with here: say so, do not pretend
            return {"skipped": "ONNX Runtime has no bf16 kernels on the CPU; bf16 plans are checked and linted, "
                               "not run, before a GPU runs them"}
        reference = cpu_reference(self.whole, plan.quant.activations, plan.kv_cache.dtype, plan.kv_cache.block_size)
        try:
            verification = verify_ranks(reference, [r.directory for r in lowered], plan.group, plan.pp,
                                        self.vocab_size, plan.kv_cache.block_size)
        except EngineError as exc:
            raise KilnError(f"verify: {exc}") from None
        record = verification.record()
        limit, problem = judge(verification, plan.quant.activations, plan.kv_cache.dtype,
                               fp8_activations=any("act_scale" in n.attrs for n in self.whole.nodes))
        record["tolerance"] = round(limit, 6)
        if problem:
            raise KilnError(f"verify: {problem}; the lowering is wrong for this model: nothing was written")
        return record

    def _compile(self, tmp: Path, lowered, chain: Toolchain, ranks: list[dict], graphs: list[Graph],
                 plugin: dict) -> dict:
        blocks = max(1, min(_pool_blocks(self.plan, g) for g in graphs))

        def fit(rank: int, needed: int) -> int:
            """The memory plan with TensorRT's activation memory where it exceeds the estimate (fewer KV blocks),
            or the memory plan's one-line refusal when the rank then does not fit."""
            planned = int(graphs[rank].meta["memory"]["workspace_bytes"])
            if needed <= planned:
                return planned
            graphs[rank].meta["memory"] = memory_record(rank_memory(graphs[rank], self.plan, rank, needed), rank)
            return needed

        return compile_ranks(tmp, [r.directory for r in lowered], chain, self.compute_capability,
                             profile_of(self.plan, blocks), ranks, self.plan.group, tmp / plugin["file"], fit)


def tolerance(activations: str, kv_dtype: str, max_abs_logit: float, fp8_activations: bool = False) -> float:
    """The largest |logit difference| from the cpu engine a build accepts (see F32_TOLERANCE and FP8_TOLERANCE)."""
    if fp8_activations or kv_dtype == "fp8":
        return FP8_TOLERANCE * max_abs_logit
    if activations != "f32":
        return HALF_TOLERANCE * max_abs_logit
    return F32_TOLERANCE + (HALF_KV_TOLERANCE * max_abs_logit if kv_dtype != "f32" else 0.0)


def judge(verification, activations: str, kv_dtype: str, fp8_activations: bool = False,
          limit: float | None = None) -> tuple[float, str | None]:
    """(the tolerance, and what the ONNX's verification fails of it or None): the largest |logit difference| from
    the cpu engine. limit: a tolerance to use instead of the plan's."""
    if limit is None:
        limit = tolerance(activations, kv_dtype, verification.max_abs_logit, fp8_activations)
    what = f"{activations} activations, {kv_dtype} KV cache" + (", fp8 activations" if fp8_activations else "")
    if verification.max_abs_logit_diff > limit:
        return limit, (f"ONNX Runtime's logits differ from the cpu engine's by {verification.max_abs_logit_diff:.3g} "
                       f"(limit {limit:.3g}: {what})")
    return limit, None


def profile_of(plan: Plan, blocks: int) -> Profile:
    return Profile(plan.limits.max_num_tokens, plan.limits.max_batch_size, plan.limits.max_seq_len,
                   plan.kv_cache.block_size, blocks)


def compile_ranks(out: Path, onnx_dirs: list[Path], chain: Toolchain, cc: str, profile: Profile,
                  ranks: list[dict], tp: int, plugin: Path, fit: Callable[[int, int], int]) -> dict:
    """rank{r}.engine in `out` for each rank's ONNX (one engine a rank); updates the rank entries; the compile
    record. fit(rank, TensorRT's activation bytes) -> the workspace the rank's memory plan now holds (a KilnError
    when the rank no longer fits)."""
    compiled = []
    for rank, directory in enumerate(onnx_dirs):
        result = compile_rank(directory, chain, cc, profile, tp, plugin, _timing_cache(chain, cc))
        if result.activation_bytes is None:
            raise KilnError(f"tensorrt: rank {rank}: TensorRT reported no activation memory, so the memory plan "
                            "cannot count it; nothing was written")
        workspace = fit(rank, result.activation_bytes)
        doc = json.loads((directory / PROGRAM_FILE).read_text())
        program = json.dumps(engine_program(doc, result), indent=1, sort_keys=True)
        path = out / f"rank{rank}.engine"
        blob = torch.frombuffer(bytearray(result.engine), dtype=torch.uint8)
        write_rank_file(path, rank, program, {"engine": ("u8", tuple(blob.shape))}, lambda name: blob)
        ranks[rank].update(file=path.name, bytes=path.stat().st_size, sha256=sha256_file(path),
                           engine=dict(result.record(), workspace_bytes=workspace))
        compiled.append(result)
    return {"compiled": True, **chain.record(), "compute_capability": cc,
            "build_seconds": [round(c.seconds, 2) for c in compiled], "engines_per_rank": 1,
            "profile": {"max_num_tokens": profile.max_num_tokens, "max_batch_size": profile.max_batch_size,
                        "max_seq_len": profile.max_seq_len, "max_kv_blocks": profile.max_blocks}}


def engine_program(doc: dict, compiled: CompiledRank) -> dict:
    """The rank file's program: the engine, between a pipeline stage's recv and send."""
    around = {s["exchange"]: s for s in doc["steps"] if s.get("exchange") in ("send", "recv")}
    steps = ([around["recv"]] if "recv" in around else []) + \
        [{"engine": "engine", "inputs": compiled.inputs, "outputs": compiled.outputs, "aliases": compiled.aliases,
          "activation_bytes": compiled.activation_bytes}] + ([around["send"]] if "send" in around else [])
    return {"outputs": doc["outputs"], "steps": steps}


def write_kernels(out: Path, lowered, cc: str, vocab_size: int | None) -> dict:
    """The plugin's kernels, and with vocab_size (a one-rank engine) the device sampler's, compiled by Triton for
    compute capability cc, as kernels/ (the cuda target's index)."""
    triton = find_triton()
    variants = sampler_kernels(vocab_size) if vocab_size else {}
    for rank in lowered:
        variants.update(rank.kernels)
    compiled = [compile_variant(kernel, variant, cc) for kernel, variant in variants.values()]
    for ck in compiled:
        if ck.global_scratch:
            raise KilnError(f"tensorrt: kernel {ck.variant.key} needs Triton's global scratch, which the "
                            "PagedAttention plugin does not allocate")
    header = {"arch": ARCHES[cc], "compute_capability": cc, "triton": triton.__version__}
    digest = write_index(out, header, compiled)
    return dict(header, index=INDEX, index_sha256=digest, kernels=len(compiled),
                cubin_bytes=sum(len(c.cubin) for c in compiled))


def write_plugin(out: Path) -> dict:
    """The PagedAttention plugin library, compiled with g++ into plugins/; its manifest record."""
    try:
        path = build_library(out / "plugins")
    except PluginError as exc:
        raise KilnError(f"tensorrt: {exc}") from None
    return {"file": f"plugins/{LIBRARY}", "sha256": sha256_file(path), "source": source_digest()}


def compile_engine(engine: Path) -> dict:
    """`engine-build compile`: compile an --onnx-only tensorrt engine's ONNX in place; the new manifest.
    The rank files are written beside the engine's files first; the manifest is replaced last."""
    try:
        manifest = Manifest.read(engine)
    except EngineError as exc:
        raise KilnError(str(exc)) from None
    doc = json.loads((engine / "manifest.json").read_text())
    if "tensorrt" not in doc:  # the manifest section only tensorrt builds write
        raise KilnError(f"compile: {engine} is a {doc['target']['name']} engine; only tensorrt engines compile")
    if doc["tensorrt"].get("compiled"):
        raise KilnError(f"compile: {engine} is compiled already ({doc['tensorrt']['flavour']} "
                        f"{doc['tensorrt']['version']}); rebuild it to compile again")
    cc = manifest.compute_capability
    chain = find_toolchain(cc)
    try:
        check_files(engine, manifest, "onnxruntime")  # the ONNX it compiles, as the manifest lists them
    except EngineError as exc:
        raise KilnError(f"compile: {exc}") from None
    blocks = min(m.kv_blocks for m in manifest.memory) or 1
    plan = doc["plan"]
    profile = Profile(plan["limits"]["max_num_tokens"], plan["limits"]["max_batch_size"],
                      plan["limits"]["max_seq_len"], plan["kv_cache"]["block_size"], blocks)
    staging = engine / ".compile"
    staging.mkdir(exist_ok=True)
    try:
        record = compile_ranks(staging, [engine / r.onnx_dir for r in manifest.ranks], chain, cc, profile,
                               doc["ranks"], plan["tp"], engine / doc["tensorrt"]["plugins"][0]["library"],
                               lambda rank, needed: _refit(doc, rank, needed))
        for path in staging.iterdir():
            path.chmod(0o644)
            path.rename(engine / path.name)
    finally:
        for path in staging.iterdir():
            path.unlink()
        staging.rmdir()
    doc["tensorrt"].update(record)
    doc["target"]["tensorrt"] = chain.record()
    (engine / "manifest.json.tmp").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    (engine / "manifest.json.tmp").rename(engine / "manifest.json")
    (engine / "report.md").write_text(render_report(doc))
    return doc


def _refit(doc: dict, rank: int, needed: int) -> int:
    """compile_ranks' fit for an engine compiled after its build: its manifest's memory plan re-priced."""
    entry, plan = doc["memory"]["ranks"][rank], doc["plan"]
    if needed <= entry["workspace_bytes"]:
        return entry["workspace_bytes"]
    limits, kv = plan["limits"], plan["kv_cache"]
    memory = RankMemoryPlan(weight_bytes=entry["weight_bytes"], workspace_bytes=needed,
                            kv_bytes_per_token=entry["kv_bytes_per_token"],
                            memory_bytes=load_devices()[plan["device"]].memory_gib * GIB,
                            memory_fraction=kv["memory_fraction"], block_size=kv["block_size"],
                            max_seq_len=limits["max_seq_len"], max_batch_size=limits["max_batch_size"],
                            max_num_tokens=limits["max_num_tokens"])
    problem = memory.problem(plan["device"], rank)
    if problem:
        raise KilnError(problem)
    entry.update(workspace_bytes=needed, kv_blocks=memory.kv_blocks, max_concurrency=memory.max_concurrency)
    return needed


def _expected_parser(cc: str) -> tuple[str, str]:
    """The TensorRT an --onnx-only build is meant for: TensorRT-RTX for what it targets, else TensorRT 10."""
    return ("tensorrt-rtx", "1") if cc in RTX_TARGETS else ("tensorrt", "10")


def _check(directory: Path, program: list[dict], table, rank: int) -> None:
    """onnx.checker with shape inference, and the TensorRT lint, on every segment of a rank."""
    for item in program:
        if "segment" not in item:
            continue
        path = directory / item["segment"]
        try:
            onnx.checker.check_model(str(path), full_check=True)
        except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
            raise KilnError(f"onnx check: rank {rank} {item['segment']}: {' '.join(str(exc).split())[:300]}") from None
        problems = lint_model(onnx.load(str(path), load_external_data=False), table)
        if problems:
            raise KilnError(f"lint: rank {rank} {item['segment']}: {problems[0]}"
                            + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))


def _io_contract(program: list[dict]) -> dict:
    """What a runtime feeds and takes: step inputs, exchanges in order, KV pools per segment."""
    segments = [item for item in program if "segment" in item]
    return {"segments": len(segments),
            "exchanges": [item["exchange"] for item in program if "exchange" in item],
            "kv_layers": sorted({layer for s in segments for layer in s["kv_layers"]})}


def _pool_blocks(plan: Plan, graph: Graph) -> int:
    """Most KV blocks a pool may hold: the rank's memory plan (plan_memory, runtime.format.memory_plan)."""
    return max(1, int(graph.meta["memory"]["kv_blocks"]))


def _timing_cache(chain: Toolchain, cc: str) -> Path:
    """A timing cache per TensorRT version and GPU, kept between builds (outside the engine directory)."""
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kiln"
    root.mkdir(parents=True, exist_ok=True)
    return root / f"timing-{chain.flavour}-{chain.version}-sm{cc.replace('.', '')}.cache"


def manifest_target(plan: Plan) -> dict:
    device = load_devices()[plan.device]
    return {"name": "tensorrt", "requires": {"gpu_arch": device.arch, "compute_capability": device.compute_capability}}
