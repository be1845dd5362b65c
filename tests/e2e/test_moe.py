"""Mixtures of experts from Hugging Face directories: Mixtral (top-2, renormalised), Qwen2-MoE (a shared expert
with its own gate, dense layers between the sparse ones), Qwen3-MoE (q/k norms per head) and OLMoE (q/k norms over
the whole projection, top-3 without renormalisation).

Each tiny random checkpoint, saved with transformers, builds into an engine whose logits match transformers at
every position and whose greedy tokens are transformers' own; its experts are quantized like linears; tensor- and
pipeline-parallel rank programs (the experts split across the tp ranks) give the one-rank logits."""

import json
from pathlib import Path

import pytest
import torch
from test_sharding import IDS, ThreadRanks, rank_graphs
from test_tensorrt import needs_tensorrt
from transformers import AutoModelForCausalLM

from builder.build import build_engine
from builder.errors import KilnError
from builder.sources import load_model
from conftest import assert_logits_match, exact_plan, make_tiny_llama, transformers_greedy
from runtime.core.engine import EngineOptions, LLMEngine
from runtime.format.engine_format import map_rank_file
from runtime.ops import moe, reference
from runtime.core.sampling import SamplingParams

PROMPTS = [[1, 5, 9, 2, 77, 31], [3], list(range(10, 60))]
# family -> the config fields of its tiny checkpoint (on TINY_LLAMA: 4 layers, hidden 64, 4 query / 2 KV heads)
FAMILIES = {
    "mixtral": dict(num_local_experts=5, num_experts_per_tok=2),  # 5 experts: tp=2 splits them 2 + 3
    "qwen2_moe": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=64,
                      shared_expert_intermediate_size=96, decoder_sparse_step=2, qkv_bias=True),
    "qwen3_moe": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True),
    "olmoe": dict(num_experts=6, num_experts_per_tok=3, intermediate_size=64),
}


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {family: make_tiny_llama(root / family, family=family, seed=7, **config)
            for family, config in FAMILIES.items()}


@pytest.fixture(scope="module")
def moe_engines(moe_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_engines")
    engines = {}
    for family, model_dir in moe_dirs.items():
        build_engine(str(model_dir), exact_plan(method="none"), root / family, show_progress=False)
        engines[family] = root / family
    return engines


def reference_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_greedy_tokens_are_transformers_own(family, moe_dirs, moe_engines):
    model = reference_model(moe_dirs[family])
    assert_logits_match(model, moe_engines[family], PROMPTS)
    llm = LLMEngine.from_dir(moe_engines[family], EngineOptions(kv_cache_gib=0.02))
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for ids in PROMPTS:
        assert llm.generate([ids], params)[0].token_ids == transformers_greedy(model, ids, 32), (family, ids)


def test_configs_and_checkpoint_names_are_read_per_family(moe_dirs):
    mixtral = load_model(str(moe_dirs["mixtral"]))
    c = mixtral.config
    assert (c.num_experts, c.experts_per_token, c.norm_topk_prob, c.moe_layers) == (5, 2, True, (0, 1, 2, 3))
    state = reference_model(moe_dirs["mixtral"]).state_dict()
    # transformers holds Mixtral's experts stacked ([E, 2I, H] gate | up); the checkpoint's w1/w3/w2 are Kiln's
    # gate/up/down projections
    gate_up = state["model.layers.1.mlp.experts.gate_up_proj"][3]
    assert torch.equal(torch.cat([mixtral.load("layers.1.mlp.experts.3.gate_proj.weight"),
                                  mixtral.load("layers.1.mlp.experts.3.up_proj.weight")]), gate_up)
    assert torch.equal(mixtral.load("layers.1.mlp.router.weight"), state["model.layers.1.mlp.gate.weight"])

    qwen = load_model(str(moe_dirs["qwen2_moe"])).config
    assert qwen.moe_layers == (1, 3) and qwen.shared_expert_intermediate_size == 96 and not qwen.norm_topk_prob
    names = load_model(str(moe_dirs["qwen2_moe"])).weight_names()
    assert "layers.0.mlp.gate_proj.weight" in names and "layers.1.mlp.gate_proj.weight" not in names
    assert "layers.1.mlp.shared_expert_gate.weight" in names
    olmoe = load_model(str(moe_dirs["olmoe"])).config
    assert olmoe.qk_norm_full and olmoe.experts_per_token == 3 and not olmoe.norm_topk_prob


def test_unsupported_variants_are_refused_by_name(moe_dirs, tmp_path):
    import shutil

    clipped = tmp_path / "olmoe_clipped"
    shutil.copytree(moe_dirs["olmoe"], clipped)
    config = json.loads((clipped / "config.json").read_text())
    (clipped / "config.json").write_text(json.dumps({**config, "clip_qkv": 8.0}))
    with pytest.raises(KilnError, match=r"clip_qkv=8.0 \(OLMoE's clamped q, k and v\) is not supported"):
        load_model(str(clipped))
    config = json.loads((moe_dirs["mixtral"] / "config.json").read_text())
    deepseek = tmp_path / "deepseek"
    shutil.copytree(moe_dirs["mixtral"], deepseek)
    (deepseek / "config.json").write_text(json.dumps({**config, "model_type": "deepseek_v3"}))
    with pytest.raises(KilnError, match="unsupported architecture 'deepseek_v3'"):
        load_model(str(deepseek))


def test_router_weights_follow_each_family():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    weights, ids = reference.route(logits, 2, norm_topk_prob=False)
    probs = torch.softmax(logits, -1)[0]
    assert ids.tolist() == [[0, 1]] and torch.allclose(weights, probs[:2][None])
    renormalised, _ = reference.route(logits, 2, norm_topk_prob=True)
    assert torch.allclose(renormalised, (probs[:2] / probs[:2].sum())[None])


def test_a_step_reads_only_the_experts_its_tokens_chose(moe_engines):
    # Poison every expert no token of the step chose: the output must not change (NaN would spread otherwise).
    program, tensors = map_rank_file(moe_engines["mixtral"] / "rank0.engine")
    node = next(n for n in json.loads(program)["nodes"] if n["op"] == "moe")
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    clean = moe.bind_moe(node, tensors)(x)
    operands = moe.operands_by_linear(node, tensors)
    _, ids = reference.route(torch.nn.functional.linear(x, operands["router"]["weight"]), 2, True)
    unused = sorted(set(range(5)) - set(ids.flatten().tolist()))
    assert unused, "the step should leave an expert unread"
    poisoned = dict(tensors)
    for e in unused:
        for proj in ("gate_up_proj", "down_proj"):  # gate and up stacked by passes/fuse_gate_up.py
            name = f"{node['name']}.experts.{e}.{proj}.weight"
            poisoned[name] = torch.full_like(tensors[name], float("nan"))
    assert torch.equal(moe.bind_moe(node, poisoned)(x), clean)


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_experts_are_quantized_per_expert_and_the_router_stays_float(moe_dirs, tmp_path, method):
    plan = exact_plan(method=method, max_ppl_increase=None, min_greedy_agreement=None)
    build_engine(str(moe_dirs["qwen2_moe"]), plan, tmp_path / "e", show_progress=False)
    program, _ = map_rank_file(tmp_path / "e" / "rank0.engine")
    node = next(n for n in json.loads(program)["nodes"] if n["op"] == "moe")
    formats = {entry["name"]: entry["quant"] for entry in node["attrs"]["linears"]}
    assert formats["router"] == formats["shared_expert_gate"] == "none"
    # each expert's gate and up stacked into one gate_up_proj (passes/fuse_gate_up.py), as the dense MLPs' are
    assert {formats[f"experts.{e}.{p}"] for e in range(6) for p in ("gate_up_proj", "down_proj")} == {method}
    assert formats["shared_expert.gate_up_proj"] == formats["shared_expert.down_proj"] == method
    manifest = json.loads((tmp_path / "e" / "manifest.json").read_text())
    # the experts' and shared experts' gate_up and down in the two sparse layers, the dense layers' gate_up and down,
    # qkv and o in all four
    assert manifest["accuracy"]["quantized_nodes"] == 2 * (6 * 2 + 2) + 2 * 2 + 4 * 2
    llm = LLMEngine.from_dir(tmp_path / "e", EngineOptions(kv_cache_gib=0.02))
    assert len(llm.generate([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
               .token_ids) == 8


@pytest.mark.parametrize("family, tp, ep, pp", [
    ("mixtral", 1, 2, 1),     # experts split 2 + 3, attention whole on both ranks
    ("mixtral", 2, 2, 1),     # experts split, attention by heads
    ("olmoe", 1, 2, 1),       # its whole-projection q/k norms need whole heads: expert parallelism alone
    ("qwen2_moe", 2, 1, 1),   # every expert and the shared one split by columns, as a dense MLP
    ("qwen2_moe", 1, 1, 2),   # pipeline stages: sparse and dense layers
    ("qwen3_moe", 2, 2, 2),
])
def test_rank_programs_together_give_the_one_rank_logits(moe_dirs, family, tp, ep, pp):
    one = ThreadRanks(rank_graphs(moe_dirs[family]), 1).logits(IDS)
    graphs = rank_graphs(moe_dirs[family], tp, pp, ep)
    count = FAMILIES[family].get("num_local_experts") or FAMILIES[family]["num_experts"]
    moe_nodes = [[n for n in g.nodes if n.op == "moe"][0] for g in graphs]
    if ep == 2:
        assert [n.attrs["experts"] for n in moe_nodes[:2]] == [list(range(count // 2)), list(range(count // 2, count))]
        assert [n.attrs.get("shared", False) for n in moe_nodes[:2]] == [FAMILIES[family].get(
            "shared_expert_intermediate_size", 0) > 0, False]
    elif tp == 2:  # whole expert list, half of each expert's columns (its gate's and its up's)
        gate_up = next(e for e in moe_nodes[0].attrs["linears"] if e["name"] == "experts.0.gate_up_proj")
        assert moe_nodes[0].attrs["experts"] == list(range(count)) and gate_up["out_features"] == 2 * 64 // 2
    many = ThreadRanks(graphs, max(tp, ep)).logits(IDS)
    torch.testing.assert_close(many, one, atol=1e-4, rtol=0)


def test_full_width_qk_norms_refuse_tensor_parallelism(moe_dirs):
    with pytest.raises(KilnError, match=r"normalizes q or k over all heads \(OLMoE\); tp=2 would split"):
        rank_graphs(moe_dirs["olmoe"], 2, 1)


@pytest.mark.parametrize("family, method, path", [("qwen2_moe", "none", "both"), ("olmoe", "none", "both"),
                                                  ("qwen2_moe", "int4", "slots"), ("qwen2_moe", "int4", "grouped"),
                                                  ("mixtral", "fp8", "slots"), ("mixtral", "fp8", "grouped")])
def test_the_cuda_backend_gives_the_cpu_engines_greedy_tokens(family, method, path, moe_dirs, tmp_path, monkeypatch):
    """Routing on the device, the experts (float, int4 and fp8) through expert_gemv, one launch for every (token,
    expert) pair, or grouped by expert through gemm's kernels (Triton's interpreter here), the shared expert as
    linears: the tokens of the cpu engine with the same weights, requests arriving two steps apart (decode steps
    of several sizes). "both": prefills grouped, decodes by pairs, as served."""
    from runtime.backends.cuda import ops

    if path != "both":
        monkeypatch.setattr(ops, "GROUPED_PER_EXPERT", 0 if path == "grouped" else 1 << 30)
    from test_cuda_backend import PROMPTS as CUDA_PROMPTS
    from test_cuda_backend import cuda_plan, run

    quant = {"max_ppl_increase": None, "min_greedy_agreement": None}
    cpu = build_engine(str(moe_dirs[family]), exact_plan(method=method, group_size=32, **quant), tmp_path / "cpu",
                       show_progress=False)
    cuda = build_engine(str(moe_dirs[family]), cuda_plan(method=method, group_size=32, **quant), tmp_path / "cuda",
                        show_progress=False)
    assert cuda.manifest["cuda"]["widened"] == []  # every expert in its own format
    monkeypatch.setenv("KILN_CUDA_INTERPRET", "1")
    got, llm = run(cuda.out, CUDA_PROMPTS)
    assert got == run(cpu.out, CUDA_PROMPTS)[0]
    assert ("_expert_gemv" in {key.split(".")[0] for key in llm.executor.launcher.launched}) == (path != "grouped")


@pytest.mark.parametrize("family, tp, ep", [("mixtral", 1, 2), ("qwen2_moe", 2, 2)])
def test_expert_parallel_rank_processes_give_the_one_rank_tokens(family, tp, ep, moe_dirs, moe_engines, tmp_path):
    """Real rank processes (gloo): the experts split between two ranks, their partial outputs all-reduced."""
    from runtime.launcher import open_llm_engine

    plan = exact_plan(method="none").with_overrides(tp=tp, ep=ep)
    result = build_engine(str(moe_dirs[family]), plan, tmp_path / "ep", show_progress=False)
    assert result.manifest["world_size"] == 2 and result.manifest["plan"]["ep"] == 2
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    options = EngineOptions(kv_cache_gib=0.01, rank_timeout=30)
    expected = [o.token_ids for o in LLMEngine.from_dir(moe_engines[family], options).generate(PROMPTS, params)]
    with open_llm_engine(tmp_path / "ep", options) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == expected


def test_ep_is_refused_for_a_model_without_experts_and_beside_another_tp(tiny_llama_dir, tmp_path):
    from builder.planning.plan import PlanError

    with pytest.raises(KilnError, match="ep=2, but the model has no mixture of experts to split"):
        build_engine(str(tiny_llama_dir), exact_plan(method="none").with_overrides(ep=2), tmp_path / "e",
                     show_progress=False)
    with pytest.raises(PlanError, match=r"plan command line: ep must be 1, tp \(2\) or any count with tp = 1, got 4"):
        exact_plan(method="none").with_overrides(tp=2, ep=4)


@pytest.mark.parametrize("family, tp, ep", [("qwen2_moe", 1, 1), ("qwen2_moe", 2, 1), ("mixtral", 1, 2)])
def test_the_tensorrt_targets_onnx_gives_the_cpu_engines_logits(family, tp, ep, moe_dirs, tmp_path):
    """kiln::MoE nodes (a local function of standard operators) run under ONNX Runtime by the build's verification
    against the cpu engine: prefill, decode and mixed steps, every rank stitched through its exchanges."""
    import onnx

    from builder.planning.plan import load_plan

    plans = Path(__file__).resolve().parents[2] / "plans"
    plan = load_plan(plans / "a100-tp2-int4.toml").with_overrides(tp=tp, ep=ep)
    plan = plan.with_overrides("quant", method="none", activations="f32").with_overrides("kv_cache", dtype="f32")
    build_engine(str(moe_dirs[family]), plan, tmp_path / "e", show_progress=False, onnx_only=True)
    manifest = json.loads((tmp_path / "e" / "manifest.json").read_text())
    verification = manifest["verification"]
    assert {"prefill", "decode", "mixed"} <= {step["step"] for step in verification["steps"]}
    assert all(step["max_abs_logit_diff"] <= 1e-4 for step in verification["steps"]), verification["steps"]
    assert verification["top1_agreement"] == 1.0 and verification["max_abs_logit"] > 0.1
    functions = {f.name for path in (tmp_path / "e" / manifest["ranks"][0]["onnx"]["dir"]).glob("segment*.onnx")
                 for f in onnx.load(path, load_external_data=False).functions}
    assert functions == {"PagedAttention", "MoEShared" if family == "qwen2_moe" else "MoE"}


@needs_tensorrt
def test_tensorrt_compiles_the_mixture_through_its_function_body(moe_dirs, tmp_path):
    """TensorRT for RTX parses kiln::MoEShared by inlining its body (no plugin of that name) and builds the rank's
    engine for sm_80. Nothing here can run it: TensorRT for RTX refuses this workplace's only GPUs (Hopper)."""
    from builder.planning.plan import load_plan

    plans = Path(__file__).resolve().parents[2] / "plans"
    plan = load_plan(plans / "a100-tp2-int4.toml").with_overrides(tp=1)
    plan = plan.with_overrides("quant", method="none", activations="f32").with_overrides("kv_cache", dtype="f32")
    result = build_engine(str(moe_dirs["qwen2_moe"]), plan, tmp_path / "e", show_progress=False)
    assert result.manifest["target"]["tensorrt"]["flavour"] == "tensorrt-rtx"
    engine = tmp_path / "e" / result.manifest["ranks"][0]["file"]
    assert engine.stat().st_size > 1 << 20


def test_a_batch_one_decode_step_reads_the_active_experts_bytes(moe_engines):
    """The cpu kernel's count of expert bytes read (what engine-run bench's roofline uses): top_k experts a layer
    for one token, each expert's gate_up and down once."""
    from runtime.ops.moe import ExpertReads

    llm = LLMEngine.from_dir(moe_engines["mixtral"], EngineOptions(kv_cache_gib=0.02))
    manifest = json.loads((moe_engines["mixtral"] / "manifest.json").read_text())
    config, expert_bytes = manifest["model"]["config"], manifest["memory"]["ranks"][0]["expert_bytes"]
    per_expert = expert_bytes // (config["num_layers"] * config["num_experts"])
    llm.add_request([5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    llm.step()  # the prefill: 4 tokens, up to 4 x 2 experts a layer
    before, steps = ExpertReads.bytes, 0
    while llm.has_unfinished():
        llm.step()
        steps += 1
    assert steps == 11
    assert ExpertReads.bytes - before == steps * config["num_layers"] * config["experts_per_token"] * per_expert


def test_awq_scales_a_mixture_and_keeps_its_float_function(moe_dirs, monkeypatch):
    """int4-awq: one set of scales for the router, the experts' and shared expert's gate and up (into the norm),
    scales of its own for each expert's down projection (into its up rows); an expert that too few calibration
    tokens reach keeps round to nearest. The float function is unchanged."""
    from builder.measure.calibration import GraphRunner
    from builder.graph.ir import verify
    from builder.graph.trace import trace
    from passes import fold_awq_scales as awq
    from passes.context import PassContext

    model = load_model(str(moe_dirs["qwen2_moe"]))
    graph = trace(model)
    graph.tensors = {name: model.load(name) for name in graph.weights}
    plan = exact_plan(method="int4-awq", group_size=32)
    monkeypatch.setattr(awq, "MIN_EXPERT_TOKENS", 200)  # the pass's own binding of builder.graph.experts' constant  # some of the 6 experts see fewer of the calibration tokens
    folded = awq.fold_awq_scales(graph, PassContext(plan=plan, model=model))
    verify(folded)
    norm = "layers.1.post_attention_layernorm.weight"
    assert not torch.equal(folded.tensors[norm], graph.tensors[norm])  # the mixture's scales went into its norm
    alphas, rtn = folded.meta["awq_alpha"], folded.meta["awq_rtn_experts"]
    downs = {f"layers.{i}.mlp.experts.{e}.down_proj" for i in (1, 3) for e in range(6)}
    assert set(rtn) | {name for name in alphas if name in downs} == downs and rtn and len(rtn) < len(downs)
    assert "layers.1.mlp.experts.0.gate_proj" in alphas and "layers.1.mlp.router" not in alphas
    ids = list(range(3, 60))
    expected = GraphRunner(graph).run(ids)
    torch.testing.assert_close(GraphRunner(folded).run(ids), expected, atol=1e-4 * expected.abs().max(), rtol=0)
