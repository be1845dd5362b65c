"""The tensorrt target's emission: per-rank ONNX, the checks that need no GPU, and TensorRT engines.

For every rank: lower the program to ONNX segments (builder/targets/tensorrt/lower_onnx.py), check each with
onnx.checker (shape inference included) and lint it against the ONNX operators the chosen TensorRT
parser supports (builder/targets/tensorrt/onnx_lint.py). Then verify every rank under ONNX Runtime against Kiln's cpu
engine of the same quantized program (builder/targets/tensorrt/verify_onnx.py), and compile each segment with
TensorRT (builder/targets/tensorrt/compile.py) into `rank{r}.engine`: a Kiln rank file whose tensors are
the serialized segment engines and whose program is the rank's program.json. A failing check
stops the build; nothing is written.
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

from builder.errors import KilnError
from builder.ir import Graph
from builder.plan import Plan, load_devices
from builder.targets.tensorrt.compile import RTX_TARGETS, Profile, Toolchain, compile_segments, find_toolchain
from builder.targets.tensorrt.lower_onnx import PROGRAM_FILE, lower_rank
from builder.targets.tensorrt.onnx_attention import DOMAIN, OP, PLUGIN_VERSION
from builder.targets.tensorrt.onnx_lint import lint_model, load_op_table
from builder.targets.tensorrt.verify_onnx import cpu_reference, verify_ranks
from runtime.engine_format import EngineError, sha256_file, write_rank_file

# |logit difference| a build accepts against the cpu engine: f32 activations compute the same math
# in another order; f16/bf16 activations round every activation (then: share of the largest logit).
# A half-precision KV cache adds its own: a key or value that lands on the other side of a rounding
# boundary in one of them is one f16 step (2^-11 relative) apart, and later layers carry that on.
# On a tiny Llama with int4 weights, f32 activations and an f16 cache the largest difference was
# 3e-4 of the largest logit; with an f32 cache, 1e-6.
F32_TOLERANCE = 1e-3
HALF_TOLERANCE = 0.05
HALF_KV_TOLERANCE = 0.005


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
            compile_record.update(self._compile(tmp, lowered, chain, ranks, graphs))
        target = manifest_target(plan)
        if chain is not None:
            target["tensorrt"] = chain.record()
        extras = {"target": target, "verification": record, "tensorrt": {
            **compile_record,
            "plugins": [{"name": OP, "namespace": DOMAIN, "version": PLUGIN_VERSION, "registered": False,
                         "fallback": "TensorRT compiles the node's reference body (gather-based: correct, slow)"}],
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
            verification = verify_ranks(reference, [r.directory for r in lowered], plan.tp, plan.pp,
                                        self.vocab_size, plan.kv_cache.block_size)
        except EngineError as exc:
            raise KilnError(f"verify: {exc}") from None
        record = verification.record()
        limit = tolerance(plan.quant.activations, plan.kv_cache.dtype, verification.max_abs_logit)
        record["tolerance"] = round(limit, 6)
        if verification.max_abs_logit_diff > limit:
            raise KilnError(f"verify: ONNX Runtime's logits differ from the cpu engine's by "
                            f"{verification.max_abs_logit_diff:.3g} (limit {limit:.3g}, {plan.quant.activations} "
                            "activations); the lowering is wrong for this model: nothing was written")
        return record

    def _compile(self, tmp: Path, lowered, chain: Toolchain, ranks: list[dict], graphs: list[Graph]) -> dict:
        blocks = max(1, min(_pool_blocks(self.plan, g) for g in graphs))
        return compile_ranks(tmp, [r.directory for r in lowered], chain, self.compute_capability,
                             profile_of(self.plan, blocks), ranks)


def tolerance(activations: str, kv_dtype: str, max_abs_logit: float) -> float:
    """The largest |logit difference| from the cpu engine a build accepts (see F32_TOLERANCE)."""
    if activations != "f32":
        return HALF_TOLERANCE * max_abs_logit
    return F32_TOLERANCE + (HALF_KV_TOLERANCE * max_abs_logit if kv_dtype != "f32" else 0.0)


def profile_of(plan: Plan, blocks: int) -> Profile:
    return Profile(plan.limits.max_num_tokens, plan.limits.max_batch_size, plan.limits.max_seq_len,
                   plan.kv_cache.block_size, blocks)


def compile_ranks(out: Path, onnx_dirs: list[Path], chain: Toolchain, cc: str, profile: Profile,
                  ranks: list[dict]) -> dict:
    """rank{r}.engine in `out` for each rank's ONNX; updates the rank entries; the compile record."""
    cache = _timing_cache(chain, cc)
    seconds = []
    for rank, directory in enumerate(onnx_dirs):
        program = (directory / PROGRAM_FILE).read_text()
        segments = [item["segment"] for item in json.loads(program)["steps"] if "segment" in item]
        engines, times = compile_segments(directory, segments, chain, cc, profile, cache)
        seconds.append(round(sum(times), 2))
        path = out / f"rank{rank}.engine"
        tensors = {f"segment{i:02d}": torch.frombuffer(bytearray(e), dtype=torch.uint8) for i, e in enumerate(engines)}
        write_rank_file(path, rank, program, {n: ("u8", tuple(t.shape)) for n, t in tensors.items()},
                        lambda name: tensors[name])
        ranks[rank].update(file=path.name, bytes=path.stat().st_size, sha256=sha256_file(path))
    return {"compiled": True, **chain.record(), "compute_capability": cc, "build_seconds": seconds,
            "profile": {"max_num_tokens": profile.max_num_tokens, "max_batch_size": profile.max_batch_size,
                        "max_seq_len": profile.max_seq_len, "max_kv_blocks": profile.max_blocks}}


def compile_engine(engine: Path) -> dict:
    """`engine-build compile`: compile an --onnx-only tensorrt engine's ONNX in place; the new manifest.
    The rank files are written beside the engine's files first; the manifest is replaced last."""
    from builder.emit import render_report
    from runtime.engine_format import EngineError, Manifest, check_files

    try:
        manifest = Manifest.read(engine)
    except EngineError as exc:
        raise KilnError(str(exc)) from None
    doc = json.loads((engine / "manifest.json").read_text())
    if doc["target"]["name"] != "tensorrt":
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
                               doc["ranks"])
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
    """Most KV blocks a pool may hold: the rank's memory plan (plan_memory, runtime.memory_plan)."""
    return max(1, int(graph.meta["memory"]["kv_blocks"]))


def _timing_cache(chain: Toolchain, cc: str) -> Path:
    """A timing cache per TensorRT version and GPU, kept between builds (outside the engine directory)."""
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kiln"
    root.mkdir(parents=True, exist_ok=True)
    return root / f"timing-{chain.flavour}-{chain.version}-sm{cc.replace('.', '')}.cache"


def manifest_target(plan: Plan) -> dict:
    device = load_devices()[plan.device]
    return {"name": "tensorrt", "requires": {"gpu_arch": device.arch, "compute_capability": device.compute_capability}}
