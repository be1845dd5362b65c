"""GGUF files beyond llama's F32/Q4_1/Q8_0: the qwen2 architecture, every block type Kiln keeps exactly.

Tiny random Qwen2 and Llama checkpoints (hidden 256, so that rows hold whole 256-weight K-quant
blocks) are written as GGUF with the `gguf` package: F32, Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 quantized
from the weights, Q2_K, Q4_K, Q5_K and Q6_K as random blocks. The reference is the file itself,
dequantized by transformers' GGUF loader or gguf-py (gguf-py's dequantizers), never Kiln's own reading
of it.
"""

import json
from pathlib import Path

import pytest
import torch
from conftest import assert_logits_match, exact_plan, make_tiny_llama, transformers_greedy
from gguf_export import write_gguf

from builder.build import build_engine
from builder.sources.gguf_blocks import BLOCK_FORMATS
from builder.graph.interpret import Interpreter
from builder.sources import load_model
from builder.planning.plan import load_plan
from builder.planning.planner import Workload, plan_candidates
from builder.planning.shapes import load_shape
from runtime.core.engine import EngineOptions, LLMEngine
from runtime.format.engine_format import map_rank_file
from runtime.ops.linear import bind_embedding
from runtime.core.sampling import SamplingParams
from runtime.weights import FORMATS

PLANS = Path(__file__).resolve().parents[2] / "plans"
PROMPTS = [[1, 5, 9, 2, 77, 31], list(range(10, 60))]
K_SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64)
# Every block type Kiln keeps exactly, each on a weight that a test reads back: int4 (Q4_0, Q4_1, Q4_K),
# int5 (Q5_0, Q5_1, Q5_K), int6 (Q6_K) and int8 (Q8_0); gate (Q4_1) and up (Q4_0) both int4, so they fuse.
MIXED_TYPES = {"token_embd.weight": "Q6_K", "output.weight": "Q5_1", "*.attn_q.weight": "Q4_K",
               "*.attn_k.weight": "Q5_K", "*.attn_v.weight": "Q8_0", "*.attn_output.weight": "Q5_0",
               "*.ffn_gate.weight": "Q4_1", "*.ffn_up.weight": "Q4_0", "*.ffn_down.weight": "Q6_K"}
# Q2_K has no exact Kiln format: "source" requantizes it
REQUANT_TYPES = {**MIXED_TYPES, "*.ffn_down.weight": "Q2_K"}


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("qwen2_k"), seed=11, family="qwen2", **K_SHAPE)


@pytest.fixture(scope="module")
def qwen2_gguf(qwen2_dir, tmp_path_factory):
    """The Qwen2 checkpoint with every block type, and its tokenizer and chat template."""
    path = tmp_path_factory.mktemp("qwen2_gguf") / "qwen2-mixed.gguf"
    return write_gguf(path, load_model(str(qwen2_dir)), "qwen2", MIXED_TYPES, tokenizer_dir=qwen2_dir)


def transformers_from_gguf(path, **options):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                local_files_only=True, **options).eval()


def test_qwen2_gguf_keeps_hugging_face_row_order(qwen2_dir, tmp_path):
    # llama.cpp permutes q/k rows for llama only: a qwen2 file must read back unchanged, biases included.
    hf = load_model(str(qwen2_dir))
    spec = load_model(str(write_gguf(tmp_path / "qwen2.gguf", hf, "qwen2")))
    assert spec.config == hf.config and spec.config.qkv_bias
    for name in hf.weight_names():
        assert torch.equal(spec.load(name), hf.load(name)), name


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_exact_blocks_convert_to_kiln_formats_value_for_value(qwen2_dir, tmp_path, architecture):
    # Q4_K's and Q5_K's eight 6-bit sub-block scales and mins become group-32 scales and zeros / mins, Q6_K's
    # int8 sub-block scales group-16 scales; the q/k rows of a llama file are un-permuted as block bytes. The
    # packed weight each kernel dequantizes (an embedding lookup's rows) is gguf-py's float32 dequantization:
    # bit for bit for int5, int6 and int8, within an ulp for int4 (its zero point z = m + 8s is rounded).
    spec = load_model(str(write_gguf(tmp_path / "m.gguf", load_model(str(qwen2_dir)), architecture, MIXED_TYPES)))
    checked = set()
    for name in spec.weight_names():
        raw = spec.raw_blocks(name)
        if raw is None:
            assert spec.stored_type(name) == "F32", name
            continue
        block = BLOCK_FORMATS[raw.ggml_type]
        fmt, (n, k) = FORMATS[block.quant], raw.shape
        packed = fmt.pack(block.convert(raw), block.group_size)
        rows = bind_embedding({"quant": fmt.name, "layout": fmt.layout, "vocab_size": n, "hidden_size": k,
                               "group_size": block.group_size}, packed)(torch.arange(n))
        weight = spec.load(name)
        if block.quant == "int4":
            assert (rows - weight).abs().max().item() <= 2 ** -23 * weight.abs().max().item(), name
        else:
            assert torch.equal(rows, weight), name
        checked.add(raw.ggml_type)
    assert checked == set(BLOCK_FORMATS)


def test_every_block_type_dequantizes_as_transformers_does(qwen2_gguf):
    spec, state = load_model(str(qwen2_gguf)), transformers_from_gguf(qwen2_gguf).state_dict()
    for name in spec.weight_names():
        key = name if name == "lm_head.weight" else f"model.{name}"
        assert torch.equal(spec.load(name), state[key]), name


def _qwen2_engine(gguf, tmp_path_factory, method: str):
    """The mixed-block Qwen2 GGUF built with the exact plan and this [quant] method."""
    out = tmp_path_factory.mktemp("qwen2_gguf_engine") / method
    build_engine(str(gguf), exact_plan(method=method), out, show_progress=False)
    return out


@pytest.fixture(scope="module")
def float_engine(qwen2_gguf, tmp_path_factory):
    return _qwen2_engine(qwen2_gguf, tmp_path_factory, "none")


def test_k_quant_gguf_logits_match_transformers_at_every_position(qwen2_gguf, float_engine):
    assert_logits_match(transformers_from_gguf(qwen2_gguf), float_engine, PROMPTS)


def test_k_quant_gguf_greedy_tokens_and_chat_template(qwen2_gguf, qwen2_dir, float_engine):
    model = transformers_from_gguf(qwen2_gguf)
    llm = LLMEngine.from_dir(float_engine, EngineOptions(kv_cache_gib=0.02))
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for ids in PROMPTS:
        assert llm.generate([ids], params)[0].token_ids == transformers_greedy(model, ids, 32), ids
    written = json.loads((float_engine / "tokenizer_config.json").read_text())
    assert written["chat_template"] == json.loads((qwen2_dir / "tokenizer_config.json").read_text())["chat_template"]


@pytest.fixture(scope="module")
def source_engine(qwen2_gguf, tmp_path_factory):
    return _qwen2_engine(qwen2_gguf, tmp_path_factory, "source")


def test_source_method_keeps_exact_blocks_bit_for_bit(qwen2_gguf, source_engine):
    # Every block type exact: the engine computes with the file's own int4/int5/int6/int8 codes, so its logits
    # are the dequantized file's (f32 activations), and the build records that it needed no evaluation.
    program, tensors = map_rank_file(source_engine / "rank0.engine")
    nodes = json.loads(program)["nodes"]
    quants = {n["name"].split(".")[-1]: n["attrs"].get("quant") for n in nodes
              if n["op"] in ("linear", "embedding", "logits") and n["name"].startswith(("layers.0.", "embed", "lm"))}
    # q, k, v in three formats stay three linears; Q4_1 gate and Q4_0 up fuse as int4
    assert quants == {"embed_tokens": "int6", "q_proj": "int4", "k_proj": "int5", "v_proj": "int8", "o_proj": "int5",
                      "gate_up_proj": "int4", "down_proj": "int6", "lm_head": "int5"}, quants
    accuracy = json.loads((source_engine / "manifest.json").read_text())["accuracy"]
    assert accuracy["evaluated"] is False
    model = transformers_from_gguf(qwen2_gguf)
    with torch.inference_mode():
        expected = model(torch.tensor([PROMPTS[1]])).logits[0]
    # logits of about 6; f32 sums in another order differ by up to 1.1e-5 (avx512, avx2 and portable kernels)
    torch.testing.assert_close(Interpreter(program, tensors, all_logits=True).logits(PROMPTS[1]), expected,
                               atol=3e-5, rtol=0)


def test_the_planner_prices_each_block_type_at_the_bytes_of_its_kiln_format(qwen2_gguf, source_engine):
    # the file's own bytes would be off: Q5_0 takes 22 bytes a block, int5 with f16 scale and min 24; Q6_K 210
    # bytes per 256 weights, int6 with f32 scales per 16 weights 256
    built = json.loads((source_engine / "manifest.json").read_text())["memory"]["ranks"][0]["weight_bytes"]
    report = plan_candidates(load_shape(str(qwen2_gguf)), plan=exact_plan(method="source"), workload=Workload(64, 64))
    assert round(report.candidates[0].weight_gib * (1 << 30)) == built


def test_source_method_requantizes_blocks_without_a_kiln_format_and_measures_it(qwen2_dir, tmp_path):
    path = write_gguf(tmp_path / "q2k.gguf", load_model(str(qwen2_dir)), "qwen2", REQUANT_TYPES,
                      tokenizer_dir=qwen2_dir)
    build_engine(str(path), exact_plan(method="source", max_ppl_increase=100.0, min_greedy_agreement=0.0),
                 tmp_path / "e", show_progress=False)
    accuracy = json.loads((tmp_path / "e" / "manifest.json").read_text())["accuracy"]
    # Q2_K down_proj in two layers: 2 weights at int8 group 32, every other block kept
    assert accuracy["source_requantized"] == {"format": "int8 group 32", "weights": 2}
    assert accuracy["ppl_quantized"] > 0 and accuracy["kl_mean"] > 0 and "greedy_agreement_pct" in accuracy


def test_tensorrt_target_lowers_every_block_type_and_its_onnx_matches_the_cpu_engine(qwen2_gguf, tmp_path):
    # int5, int6 and int8 per group have no TensorRT form: the ONNX holds their dequantized weights. Over tp=2,
    # whose shares of k_proj rows and down_proj columns split the int5 and int6 groups at their boundaries.
    plan = load_plan(PLANS / "a100-tp2-int4.toml").with_overrides(tp=2)
    plan = plan.with_overrides("quant", method="source", activations="f32").with_overrides("kv_cache", dtype="f32")
    build_engine(str(qwen2_gguf), plan, tmp_path / "e", show_progress=False, onnx_only=True)
    verification = json.loads((tmp_path / "e" / "manifest.json").read_text())["verification"]
    assert verification["max_abs_logit"] > 0.1 and verification["top1_agreement"] == 1.0
    assert all(step["max_abs_logit_diff"] <= 1e-4 for step in verification["steps"]), verification["steps"]


def test_gemma3_gguf_reads_as_its_hugging_face_checkpoint(tmp_path):
    # Seven layers, so that llama.cpp's fixed pattern (every sixth layer global) has a global layer and
    # sliding ones on both sides; the softmax scale is 1/sqrt(head_dim), as llama.cpp assumes.
    from conftest import GEMMA3_ROPE
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_llama(tmp_path / "gemma3", seed=12, family="gemma3", sliding_window=8, num_hidden_layers=7,
                                tie_word_embeddings=True, query_pre_attn_scalar=16, rope_parameters=GEMMA3_ROPE,
                                hidden_activation="gelu_pytorch_tanh")
    hf = load_model(str(model_dir))
    assert hf.config.layer_windows == (8, 8, 8, 8, 8, 0, 8)
    path = write_gguf(tmp_path / "gemma3.gguf", hf, "gemma3", {"blk.*.weight": "Q8_0"},
                      tokenizer_dir=model_dir)
    spec = load_model(str(path))
    assert spec.config == hf.config
    assert torch.equal(spec.load("layers.3.self_attn.q_norm.weight"), hf.load("layers.3.self_attn.q_norm.weight"))
    assert torch.equal(spec.load("layers.3.pre_feedforward_layernorm.weight"),
                       hf.load("layers.3.pre_feedforward_layernorm.weight"))
    build_engine(str(path), exact_plan(method="none"), tmp_path / "e", show_progress=False)
    # the Q8_0 projections' values in the Hugging Face checkpoint: the reference is the file's own numbers
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    state = model.state_dict()
    with torch.no_grad():
        for name in spec.weight_names():
            if name.endswith("_proj.weight"):
                state[f"model.{name}"].copy_(spec.load(name))
    assert_logits_match(model, tmp_path / "e", PROMPTS)


@pytest.mark.parametrize("fixture", ["tiny_phi3_dir", "tiny_phi3_longrope_dir"])
def test_phi3_gguf_with_fused_tensors_matches_transformers(fixture, request, tmp_path):
    # llama.cpp keeps Phi-3's fused attn_qkv and ffn_up (gate | up) and stores LongRoPE's factors as tensors.
    model_dir = request.getfixturevalue(fixture)
    hf = load_model(str(model_dir))
    path = write_gguf(tmp_path / "phi3.gguf", hf, "phi3", tokenizer_dir=model_dir)
    spec = load_model(str(path))
    assert spec.config == hf.config
    for name in hf.weight_names():
        assert torch.equal(spec.load(name), hf.load(name)), name
    build_engine(str(path), exact_plan(method="none"), tmp_path / "e", show_progress=False)
    from transformers import AutoModelForCausalLM

    assert_logits_match(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), tmp_path / "e",
                        PROMPTS)


# ---------------------------------------------------------------------------------------------- mixtures of experts

# Qwen2-MoE as llama.cpp stores it: each layer's experts stacked per projection (ffn_gate_exps [E, I, H], ...), as
# a K-quant; the shared expert, its gate and attention as Q8_0 or F32.
MOE_TYPES = {"*.ffn_gate_exps.weight": "Q4_K", "*.ffn_up_exps.weight": "Q4_K", "*.ffn_down_exps.weight": "Q6_K",
             "*_shexp.weight": "Q8_0", "*.attn_*.weight": "Q8_0"}


@pytest.fixture(scope="module")
def qwen2moe_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("qwen2moe_k"), seed=12, family="qwen2_moe",
                           **{**K_SHAPE, "intermediate_size": 256}, num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=256, shared_expert_intermediate_size=256, qkv_bias=True)


@pytest.fixture(scope="module")
def qwen2moe_gguf(qwen2moe_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2moe_gguf") / "qwen2moe.gguf"
    return write_gguf(path, load_model(str(qwen2moe_dir)), "qwen2moe", MOE_TYPES, tokenizer_dir=qwen2moe_dir)


def transformers_moe_from_gguf(path, model_dir):
    """transformers' reading of the file. Its GGUF config mapping for qwen2moe (transformers 5.24) reads neither
    expert size, so the checkpoint's config.json gives the shapes; every weight comes from the file."""
    from transformers import AutoConfig

    return transformers_from_gguf(path, config=AutoConfig.from_pretrained(model_dir))


def test_stacked_experts_read_back_as_transformers_reads_them(qwen2moe_gguf, qwen2moe_dir):
    spec = load_model(str(qwen2moe_gguf))
    c = spec.config
    assert (c.num_experts, c.experts_per_token, c.expert_intermediate_size, c.shared_expert_intermediate_size,
            c.moe_layers, c.norm_topk_prob) == (4, 2, 256, 256, (0, 1), False)
    assert spec.stored_type("layers.1.mlp.experts.2.gate_proj.weight") == "Q4_K"
    state = transformers_moe_from_gguf(qwen2moe_gguf, qwen2moe_dir).state_dict()
    for name in spec.weight_names():
        parts = name.split(".")
        if parts[2:4] == ["mlp", "experts"]:  # transformers stacks gate | up as [E, 2I, H], down as [E, H, I]
            layer, e, proj = parts[1], int(parts[4]), parts[5]
            stacked = state[f"model.layers.{layer}.mlp.experts.{proj if proj == 'down_proj' else 'gate_up_proj'}"]
            expected = stacked[e] if proj == "down_proj" else stacked[e].chunk(2)[proj == "up_proj"]
        else:
            key = name.replace("mlp.router", "mlp.gate")
            expected = state[key if name == "lm_head.weight" else f"model.{key}"]
        assert torch.equal(spec.load(name), expected), name


def test_moe_gguf_logits_match_transformers_and_source_keeps_the_expert_blocks(qwen2moe_gguf, qwen2moe_dir,
                                                                               tmp_path):
    model = transformers_moe_from_gguf(qwen2moe_gguf, qwen2moe_dir)
    build_engine(str(qwen2moe_gguf), exact_plan(method="none"), tmp_path / "float", show_progress=False)
    assert_logits_match(model, tmp_path / "float", PROMPTS)
    # "source": the experts compute with the file's own Q4_K (int4) and Q6_K (int6) codes
    build_engine(str(qwen2moe_gguf), exact_plan(method="source"), tmp_path / "source", show_progress=False)
    program, tensors = map_rank_file(tmp_path / "source" / "rank0.engine")
    node = next(n for n in json.loads(program)["nodes"] if n["op"] == "moe")
    formats = {e["name"]: e["quant"] for e in node["attrs"]["linears"]}
    assert (formats["experts.3.gate_up_proj"], formats["experts.3.down_proj"], formats["shared_expert.gate_up_proj"],
            formats["router"]) == ("int4", "int6", "int8", "none")
    with torch.inference_mode():
        expected = model(torch.tensor([PROMPTS[1]])).logits[0]
    torch.testing.assert_close(Interpreter(program, tensors, all_logits=True).logits(PROMPTS[1]), expected,
                               atol=3e-5, rtol=0)


@pytest.mark.parametrize("family, architecture", [("mixtral", "llama"), ("qwen3_moe", "qwen3moe")])
def test_mixtral_and_qwen3_moe_gguf_read_as_their_checkpoints(family, architecture, tmp_path):
    # Mixtral is a llama file with expert counts (its q/k rows permuted for llama.cpp's rope, its router weights
    # renormalised); Qwen3-MoE has per-head q/k norms. F32 tensors: every weight reads back equal.
    sizes = {"mixtral": dict(num_local_experts=4), "qwen3_moe": dict(num_experts=4, moe_intermediate_size=256)}
    model_dir = make_tiny_llama(tmp_path / family, seed=13, family=family, **{**K_SHAPE, "intermediate_size": 256},
                                num_experts_per_tok=2, **sizes[family])
    hf = load_model(str(model_dir))
    spec = load_model(str(write_gguf(tmp_path / f"{family}.gguf", hf, architecture, tokenizer_dir=model_dir)))
    assert (spec.config.num_experts, spec.config.experts_per_token, spec.config.norm_topk_prob,
            spec.config.qk_norm) == (4, 2, True, family == "qwen3_moe")
    for name in hf.weight_names():
        assert torch.equal(spec.load(name), hf.load(name)), name
