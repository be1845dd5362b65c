"""Kiln against transformers on the same GGUF file: perplexity and greedy answers, for a model family.

    python benchmarks/family_agreement.py MODEL.gguf [--out /tmp/kiln-family] [--tokens 32]
        [--plans none,source]

transformers loads the file itself (its GGUF loader dequantizes every block with gguf-py), so the
reference shares nothing with Kiln's reading of the file. For each plan (the default plan with
`[quant] method` changed; "none" computes in float32 end to end, "source" keeps the file's exact
blocks and requantizes the rest) it prints the perplexity of both over the shipped evaluation text
(the build's own evaluation windows: 512 tokens, each starting as a raw prompt does, with BOS where the
tokenizer adds one), the largest logit difference, and the share of shipped chat prompts whose greedy
answers are identical token for token (with the chat template where the file has one, else the bare
message as a raw prompt).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from builder.build import build_engine
from builder.measure.calibration import WINDOW, shipped_text, windows
from builder.graph.interpret import Interpreter
from builder.planning.plan import load_plan
from runtime.core.engine import EngineOptions, LLMEngine
from runtime.format.engine_format import map_rank_file
from runtime.core.sampling import SamplingParams


def nll(logits: torch.Tensor, ids: list[int]) -> float:
    """Summed negative log-likelihood of ids[1:] under logits [T, vocab]."""
    logp = torch.log_softmax(logits[:-1].double(), dim=-1)
    return -float(logp.gather(1, torch.tensor(ids[1:])[:, None]).sum())


def prompts(llm: LLMEngine) -> list[list[int]]:
    """The shipped chat prompts as the server reads them: through the chat template where the engine has one,
    else the bare message as a raw prompt (with the special tokens the model's tokenizer adds to either)."""
    messages = [line for line in shipped_text("chat_prompts").splitlines() if line.strip()]
    templated = bool(llm.tokenizer_config.get("chat_template"))
    return [llm.encode(llm.apply_chat_template([{"role": "user", "content": m}]) if templated else m)
            for m in messages]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--out", type=Path, default=Path("/tmp/kiln-family"))
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per chat prompt")
    parser.add_argument("--plans", default="none,source")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    started = time.time()
    model = AutoModelForCausalLM.from_pretrained(args.gguf.parent, gguf_file=args.gguf.name, dtype=torch.float32,
                                                 local_files_only=True).eval()
    print(f"transformers loaded {args.gguf.name} in {time.time() - started:.0f} s")
    rows = []
    for method in args.plans.split(","):
        plan = load_plan().with_overrides("quant", method=method, activations="f32", max_ppl_increase=None,
                                          min_greedy_agreement=None)
        if method == "none":
            plan = plan.with_overrides("kv_cache", dtype="f32")
        engine = args.out / method
        started = time.time()
        build_engine(str(args.gguf), plan, engine, show_progress=True, force=True)
        print(f"built {method} in {time.time() - started:.0f} s")
        program, tensors = map_rank_file(engine / "rank0.engine")
        interpreter = Interpreter(program, tensors, all_logits=True)
        llm = LLMEngine.from_dir(engine, EngineOptions(kv_cache_gib=0.5))
        ids = llm.tokenizer.encode(shipped_text("evaluation"), add_special_tokens=False).ids
        ours = theirs = 0.0
        tokens, max_diff = 0, 0.0
        for window in windows(ids, WINDOW, llm.special_tokens):
            with torch.inference_mode():
                reference = model(torch.tensor([window])).logits[0]
            logits = interpreter.logits(window)
            max_diff = max(max_diff, float((logits - reference).abs().max()))
            ours, theirs, tokens = ours + nll(logits, window), theirs + nll(reference, window), tokens + len(window) - 1
        # min_tokens holds EOS back as transformers' min_new_tokens does
        params = SamplingParams(temperature=0.0, max_tokens=args.tokens, min_tokens=args.tokens)
        chat = prompts(llm)
        answers = [r.token_ids for r in llm.generate(chat, params)]
        same = 0
        for prompt, answer in zip(chat, answers):
            with torch.inference_mode():
                expected = model.generate(torch.tensor([prompt]), max_new_tokens=args.tokens,
                                          min_new_tokens=args.tokens, do_sample=False)[0, len(prompt):].tolist()
            same += answer == expected
        rows.append((method, math.exp(theirs / tokens), math.exp(ours / tokens), max_diff, same, len(chat), tokens))
    print("\n| Kiln plan | ppl transformers | ppl Kiln | max logit diff | identical greedy answers | eval tokens |")
    print("|---|---|---|---|---|---|")
    for method, ppl_t, ppl_k, diff, same, total, tokens in rows:
        print(f"| {method} | {ppl_t:.4f} | {ppl_k:.4f} | {diff:.2e} | {same}/{total} | {tokens} |")


if __name__ == "__main__":
    main()
