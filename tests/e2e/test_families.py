"""Model families beyond Llama, from Hugging Face directories: Qwen2 (biases on q, k and v, not o),
Mistral (sliding-window attention, windows shorter than the prompts and the generations) and Phi-3
(fused qkv and gate_up weights split on load; LongRoPE).

Each tiny random checkpoint, saved with transformers, builds into an engine whose logits match
transformers at every position and whose greedy tokens are transformers' own, on one rank and on
tensor- and pipeline-parallel ranks."""

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from builder.build import build_engine
from builder.graph.interpret import Interpreter
from builder.sources import load_model
from conftest import assert_logits_match, exact_plan, make_tiny_llama, transformers_greedy
from runtime.core.engine import EngineOptions, LLMEngine
from runtime.format.engine_format import map_rank_file
from runtime.core.sampling import SamplingParams

PROMPTS = [[1, 5, 9, 2, 77, 31], [3], list(range(10, 60))]
FAMILIES = ["tiny_qwen2_dir", "tiny_qwen2_tied_dir", "tiny_mistral_dir", "tiny_mistral_uneven_dir",
            "tiny_phi3_dir", "tiny_phi3_longrope_dir", "tiny_gemma3_dir", "tiny_gemma3_mqa_dir"]


def reference(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=FAMILIES)
def family_engine(request, tmp_path_factory):
    model_dir = request.getfixturevalue(request.param)
    out = tmp_path_factory.mktemp("families") / request.param
    build_engine(str(model_dir), exact_plan(method="none"), out, show_progress=False)
    return model_dir, out


def test_qwen2_biases_are_read_for_q_k_v_and_not_o(tiny_qwen2_dir):
    spec = load_model(str(tiny_qwen2_dir))
    assert spec.config.qkv_bias and not spec.config.attention_bias
    biases = sorted(n.split(".", 2)[2] for n in spec.weight_names() if n.endswith(".bias") and n.startswith("layers.0."))
    assert biases == ["self_attn.k_proj.bias", "self_attn.q_proj.bias", "self_attn.v_proj.bias"]
    state = reference(tiny_qwen2_dir).state_dict()
    assert torch.equal(spec.load("layers.1.self_attn.q_proj.bias"), state["model.layers.1.self_attn.q_proj.bias"])


def test_mistral_window_is_recorded_per_layer_in_the_manifest(tiny_mistral_dir, tmp_path):
    build_engine(str(tiny_mistral_dir), exact_plan(method="none"), tmp_path / "e", show_progress=False)
    manifest = json.loads((tmp_path / "e" / "manifest.json").read_text())
    assert manifest["model"]["config"]["layer_windows"] == [8, 8, 8]
    program, _ = map_rank_file(tmp_path / "e" / "rank0.engine")
    assert [n["attrs"]["window"] for n in json.loads(program)["nodes"] if n["op"] == "attention"] == [8, 8, 8]


def test_window_longer_than_every_prompt_changes_nothing(tmp_path):
    # A window wider than any context and no window at all are the same model: equal logits, to the bit.
    windowed = make_tiny_llama(tmp_path / "windowed", family="mistral", sliding_window=200)
    full = tmp_path / "full"
    shutil.copytree(windowed, full)
    config = json.loads((full / "config.json").read_text())
    (full / "config.json").write_text(json.dumps({**config, "sliding_window": None}))
    logits = []
    for model_dir in (windowed, full):
        build_engine(str(model_dir), exact_plan(method="none"), tmp_path / f"{model_dir.name}.engine",
                     show_progress=False)
        program, tensors = map_rank_file(tmp_path / f"{model_dir.name}.engine" / "rank0.engine")
        logits.append(Interpreter(program, tensors, all_logits=True).logits(PROMPTS[2]))
    assert torch.equal(*logits)


def test_phi3_fused_weights_are_split_into_kiln_projections(tiny_phi3_dir):
    spec = load_model(str(tiny_phi3_dir))
    state = reference(tiny_phi3_dir).state_dict()
    qkv, gate_up = state["model.layers.2.self_attn.qkv_proj.weight"], state["model.layers.2.mlp.gate_up_proj.weight"]
    parts = [spec.load(f"layers.2.self_attn.{p}_proj.weight") for p in "qkv"]
    assert [p.shape[0] for p in parts] == [64, 32, 32] and torch.equal(torch.cat(parts), qkv)
    assert torch.equal(torch.cat([spec.load("layers.2.mlp.gate_proj.weight"), spec.load("layers.2.mlp.up_proj.weight")]),
                       gate_up)


def test_longrope_rows_use_the_long_factors_past_the_original_length(tiny_phi3_longrope_dir):
    # transformers switches a whole sequence to the long factors once it passes 128 positions; Kiln's
    # table does so by position (keys already cached keep their rotation). Both sets, and the attention
    # factor, must be transformers' own.
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from runtime.ops.reference import RopeTable

    config = AutoConfig.from_pretrained(tiny_phi3_longrope_dir)
    short, factor = ROPE_INIT_FUNCTIONS["longrope"](config, None)
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len=129)
    spec = load_model(str(tiny_phi3_longrope_dir))
    table = RopeTable(16, spec.config.rope_theta, spec.config.rope_scaling)
    table.ensure(200)
    for position, inv_freq in [(5, short), (127, short), (128, long), (199, long)]:
        angles = position * inv_freq
        torch.testing.assert_close(table.cos[position, :8], angles.cos() * factor, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(table.sin[position, 8:], angles.sin() * factor, rtol=1e-6, atol=1e-6)
    assert factor > 1.0 and not torch.equal(short, long)


def test_logits_match_transformers_at_every_position(family_engine):
    model_dir, engine = family_engine
    assert_logits_match(reference(model_dir), engine, PROMPTS)


def test_greedy_generation_is_transformers_token_for_token(family_engine):
    model_dir, engine = family_engine
    model = reference(model_dir)
    llm = LLMEngine.from_dir(engine, EngineOptions(kv_cache_gib=0.02))
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for ids in PROMPTS:
        assert llm.generate([ids], params)[0].token_ids == transformers_greedy(model, ids, 32), ids


@pytest.mark.parametrize("method", ["int4-awq", "fp8"])
def test_gemma3_builds_with_quantization_that_reads_its_graph(tiny_gemma3_dir, tmp_path, method):
    # AWQ folds scales into the norm before each linear (Gemma: the sandwich norms), fp8 quantizes every
    # linear; both then measure the build against the float model.
    plan = exact_plan(method=method, max_ppl_increase=None, min_greedy_agreement=None)
    build_engine(str(tiny_gemma3_dir), plan, tmp_path / "e", show_progress=False)
    accuracy = json.loads((tmp_path / "e" / "manifest.json").read_text())["accuracy"]
    assert accuracy["method"] == method and accuracy["quantized_nodes"] > 0 and accuracy["kl_mean"] > 0
