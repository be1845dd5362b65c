"""Section 3's models and yardsticks for benchmarks/gpu_check.py.

Random-weight checkpoints: a Llama-3.1-8B-shaped one (plans/models.toml's llama-3.1-8b, with Llama 3.1's rope
scaling) saved in bf16, and the unit tests' tiny llama (tests/conftest.py's recipe) for --interpret; both saved by
transformers as Hugging Face directories with a small byte-level BPE tokenizer and a chat template (throughput
needs token ids, not words). The device's copy bandwidth, transformers' own decode speed on a checkpoint, and the
throughput section's goals (issue 68's figures for an H100)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5,
                max_position_embeddings=131072, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192})
TINY_LLAMA = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
                  max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.1, bos_token_id=1,
                  eos_token_id=2)
LONG_CONTEXT = 4096 - 64  # the 8B bf16 engine's long-context decode row (its max_seq_len is 4096)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["The quick brown fox jumps over the lazy dog.", "Hello world! How are you today? I am fine, thank you.",
          "user assistant system: you are a helpful assistant named Kiln.",
          "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 2024; symbols ( ) [ ] { } < > = + - * / % # @ & ! ? , . : ;"] * 4


def write_tokenizer(path: Path, vocab_size: int | None) -> None:
    """tokenizer.json (a byte-level BPE trained on CORPUS; padded with reserved tokens to vocab_size if given)
    and tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=vocab_size or 300, special_tokens=SPECIALS, min_frequency=1, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if vocab_size:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(vocab_size - tok.get_vocab_size())])
    (path / "tokenizer.json").write_text(tok.to_str())
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": SPECIALS[1], "eos_token": SPECIALS[2], "unk_token": SPECIALS[0], "chat_template": CHAT_TEMPLATE,
         "tokenizer_class": "PreTrainedTokenizerFast"}))


def random_llama(path: Path, config: dict, on_gpu: bool) -> None:
    """A seeded random LlamaForCausalLM(config) saved at path: made on the GPU in bf16 (on_gpu: 16 GB for the
    8B, initialised in seconds), else on the CPU in f32. The tokenizer is written last: its presence marks a
    complete checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    if on_gpu:
        torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda" if on_gpu else "cpu"):
            model = LlamaForCausalLM(LlamaConfig(**config)).eval()
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(path, safe_serialization=True, max_shard_size="5GB")
    del model
    write_tokenizer(path, None if on_gpu else config["vocab_size"])


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device copy of 2 GiB (read + write: 2 * bytes / time), 20 copies after 3 of warm-up."""
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        y.copy_(x)
    end.record()
    end.synchronize()
    return 2 * x.numel() * 20 / (start.elapsed_time(end) / 1e3)


def transformers_decode(path: Path, batches, new_tokens: int, log=print) -> list[dict]:
    """transformers' generate on the GPU in bf16 with a static cache, greedy, 128-token random prompts: decode
    tok/s = batch * (new_tokens - 1) / (time of new_tokens - time of 1), after a warm-up run (where transformers
    compiles its static-cache decode step)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda").eval()

    def generate(ids: torch.Tensor, n: int) -> float:
        torch.cuda.synchronize()
        started = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, cache_implementation="static", pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - started

    rows = []
    for b in batches:
        ids = torch.randint(0, model.config.vocab_size, (b, 128), generator=torch.Generator().manual_seed(b)).cuda()
        generate(ids, new_tokens)
        full, one = generate(ids, new_tokens), generate(ids, 1)
        rows.append({"engine": "transformers bf16 (static cache)", "mode": f"decode batch {b}",
                     "tok/s": b * (new_tokens - 1) / (full - one), "step ms": 1e3 * (full - one) / (new_tokens - 1)})
        log(f"transformers: decode batch {b}: {rows[-1]['tok/s']:.1f} tok/s")
    return rows


def goal(text: str, met: bool | None, figure: str) -> dict:
    return {"goal": text, "figure": figure, "status": "not measured" if met is None else "met" if met else "missed"}


def throughput_goals(rows: list[dict]) -> list[dict]:
    """The throughput section's goals from its rows (engine, mode, tok/s, step ms, share of copy bw)."""
    rate = {(r["engine"], r["mode"]): r["tok/s"] for r in rows}
    step = {(r["engine"], r["mode"]): r["step ms"] for r in rows}
    share = next((r.get("share of copy bw") for r in rows if (r["engine"], r["mode"]) == ("8B bf16", "decode batch 1")),
                 None)

    def ratio(a, b):
        return None if a is None or b is None else a / b

    def check(text: str, value: float | None, met, unit: str = "x") -> dict:
        return goal(text, None if value is None else met(value), "not measured" if value is None else
                    f"{value:.2f}{unit}")

    b1 = rate.get(("8B bf16", "decode batch 1"))
    return [check("8B bf16 batch-1 decode >= 85% of measured copy bandwidth (80% at the least)",
                  None if share is None else 100 * share, lambda v: v >= 85, "%"),
            check(f"8B bf16 decode at context {LONG_CONTEXT} <= 1.15x the 128-token step",
                  ratio(step.get(("8B bf16", f"decode batch 1, context {LONG_CONTEXT}")),
                        step.get(("8B bf16", "decode batch 1"))), lambda v: v <= 1.15),
            check("8B fp8 >= 1.6x bf16 at batch 1", ratio(rate.get(("8B fp8", "decode batch 1")), b1),
                  lambda v: v >= 1.6),
            check("8B fp8 batch-8 step <= 1.2x its batch-1 step", ratio(step.get(("8B fp8", "decode batch 8")),
                                                                      step.get(("8B fp8", "decode batch 1"))),
                  lambda v: v <= 1.2),
            check("8B int4 >= 2.0x bf16 at batch 1 (1.6x at the least)",
                  ratio(rate.get(("8B int4", "decode batch 1")), b1), lambda v: v >= 2.0),
            check("8B bf16 >= 9,500 tok/s at batch 64", rate.get(("8B bf16", "decode batch 64")),
                  lambda v: v >= 9500, " tok/s"),
            check("8B bf16 >= 22,000 tok/s at batch 256", rate.get(("8B bf16", "decode batch 256")),
                  lambda v: v >= 22000, " tok/s")]
