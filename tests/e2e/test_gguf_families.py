"""GGUF files beyond llama's F32/Q4_1/Q8_0: the qwen2 architecture and K-quant blocks.

Tiny random Qwen2 and Llama checkpoints (hidden 256, so that rows hold whole 256-weight K-quant
blocks) are written as GGUF with the `gguf` package: F32, Q4_0, Q4_1 and Q8_0 quantized from the
weights, Q4_K, Q5_K and Q6_K as random blocks. The reference is the file itself, dequantized by
transformers' GGUF loader (gguf-py's dequantizers), never Kiln's own reading of it.
"""

import json

import pytest
import torch
from conftest import assert_logits_match, exact_plan, make_tiny_llama, transformers_greedy
from gguf_export import write_gguf

from builder.build import build_engine
from builder.gguf_source import BLOCK_FORMATS
from builder.interpret import Interpreter
from builder.model import load_model
from runtime.engine import EngineOptions, LLMEngine
from runtime.engine_format import map_rank_file
from runtime.sampling import SamplingParams

PROMPTS = [[1, 5, 9, 2, 77, 31], list(range(10, 60))]
K_SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64)
# Every block type, each on a weight that a test reads back: exact ones (Q4_0, Q4_1, Q4_K, Q8_0) and
# ones Kiln has no format for (Q5_K, Q6_K).
MIXED_TYPES = {"token_embd.weight": "Q6_K", "output.weight": "Q8_0", "*.attn_q.weight": "Q4_K",
               "*.attn_k.weight": "Q5_K", "*.attn_v.weight": "Q8_0", "*.attn_output.weight": "Q4_0",
               "*.ffn_gate.weight": "Q4_1", "*.ffn_up.weight": "Q4_K", "*.ffn_down.weight": "Q6_K"}
EXACT_TYPES = {pattern: kind for pattern, kind in MIXED_TYPES.items() if kind in BLOCK_FORMATS}


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("qwen2_k"), seed=11, family="qwen2", **K_SHAPE)


@pytest.fixture(scope="module")
def qwen2_gguf(qwen2_dir, tmp_path_factory):
    """The Qwen2 checkpoint with every block type, and its tokenizer and chat template."""
    path = tmp_path_factory.mktemp("qwen2_gguf") / "qwen2-mixed.gguf"
    return write_gguf(path, load_model(str(qwen2_dir)), "qwen2", MIXED_TYPES, tokenizer_dir=qwen2_dir)


def transformers_from_gguf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                local_files_only=True).eval()


def test_qwen2_gguf_keeps_hugging_face_row_order(qwen2_dir, tmp_path):
    # llama.cpp permutes q/k rows for llama only: a qwen2 file must read back unchanged, biases included.
    hf = load_model(str(qwen2_dir))
    spec = load_model(str(write_gguf(tmp_path / "qwen2.gguf", hf, "qwen2")))
    assert spec.config == hf.config and spec.config.qkv_bias
    for name in hf.weight_names():
        assert torch.equal(spec.load(name), hf.load(name)), name


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_exact_blocks_convert_to_kiln_formats_value_for_value(qwen2_dir, tmp_path, architecture):
    # Q4_K's eight 6-bit sub-block scales and mins become int4 group-32 scale and zero; the q/k rows of a
    # llama file are un-permuted as block bytes. Each rebuilt weight equals gguf-py's dequantization.
    spec = load_model(str(write_gguf(tmp_path / "m.gguf", load_model(str(qwen2_dir)), architecture, MIXED_TYPES)))
    checked = set()
    for name in spec.weight_names():
        raw = spec.raw_blocks(name)
        if raw is None:
            assert spec.stored_type(name) in ("F32", "Q5_K", "Q6_K"), name
            continue
        quant, convert = BLOCK_FORMATS[raw.ggml_type]
        parts = convert(raw)
        groups = parts[0].float().view(*parts[1].shape, 32)
        if quant == "int4":
            assert parts[0].dtype == torch.uint8 and int(parts[0].max()) <= 15
            rebuilt = (groups - 8) * parts[1][..., None] + parts[2][..., None]
        else:
            rebuilt = groups * parts[1][..., None]
        weight = spec.load(name)
        assert (rebuilt.view(weight.shape) - weight).abs().max().item() <= 1e-6 * max(1.0, weight.abs().max().item())
        checked.add(raw.ggml_type)
    assert checked == {"Q4_0", "Q4_1", "Q4_K", "Q8_0"}


def test_every_block_type_dequantizes_as_transformers_does(qwen2_gguf):
    spec, state = load_model(str(qwen2_gguf)), transformers_from_gguf(qwen2_gguf).state_dict()
    for name in spec.weight_names():
        key = name if name == "lm_head.weight" else f"model.{name}"
        assert torch.equal(spec.load(name), state[key]), name


@pytest.fixture(scope="module")
def float_engine(qwen2_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen2_gguf_engine") / "none"
    build_engine(str(qwen2_gguf), exact_plan(method="none"), out, show_progress=False)
    return out


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


def test_source_method_keeps_exact_blocks_bit_for_bit(qwen2_dir, tmp_path):
    # Only exact block types: the engine computes with the file's own int4/int8 codes, so its logits are
    # the dequantized file's (f32 activations), and the build records that it needed no evaluation.
    path = write_gguf(tmp_path / "exact.gguf", load_model(str(qwen2_dir)), "qwen2", EXACT_TYPES,
                      tokenizer_dir=qwen2_dir)
    build_engine(str(path), exact_plan(method="source"), tmp_path / "e", show_progress=False)
    program, tensors = map_rank_file(tmp_path / "e" / "rank0.engine")
    quants = {n["name"].split(".")[-1]: n["attrs"].get("quant") for n in json.loads(program)["nodes"]
              if n["op"] == "linear" and n["name"].startswith("layers.0.")}
    # q, k, v in three formats stay three linears; Q4_1 gate and Q4_K up fuse as int4; Q6_K down stays float
    assert quants == {"q_proj": "int4", "k_proj": "none", "v_proj": "int8", "o_proj": "int4", "gate_up_proj": "int4",
                      "down_proj": "none"}, quants
    accuracy = json.loads((tmp_path / "e" / "manifest.json").read_text())["accuracy"]
    assert accuracy["evaluated"] is False
    model = transformers_from_gguf(path)
    with torch.inference_mode():
        expected = model(torch.tensor([PROMPTS[1]])).logits[0]
    torch.testing.assert_close(Interpreter(program, tensors, all_logits=True).logits(PROMPTS[1]), expected,
                               atol=1e-4, rtol=0)


def test_source_method_requantizes_blocks_without_a_kiln_format_and_measures_it(qwen2_gguf, tmp_path):
    build_engine(str(qwen2_gguf), exact_plan(method="source", max_ppl_increase=100.0, min_greedy_agreement=0.0),
                 tmp_path / "e", show_progress=False)
    accuracy = json.loads((tmp_path / "e" / "manifest.json").read_text())["accuracy"]
    # Q5_K (k_proj) and Q6_K (embedding, down_proj) in two layers: 1 + 2 x 2 weights at int8 group 32
    assert accuracy["source_requantized"] == {"format": "int8 group 32", "weights": 5}
    assert accuracy["ppl_quantized"] > 0 and accuracy["kl_mean"] > 0 and "greedy_agreement_pct" in accuracy


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
