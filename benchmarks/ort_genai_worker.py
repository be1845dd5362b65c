"""ONNX Runtime GenAI behind a pipe, for benchmarks/bench_quant.py: run by the Python of a venv that has
onnxruntime-genai, it loads one model folder and answers one JSON request per line on stdin.

    {"op": "decode", "prompts": [[ids]], "tokens": N} -> {"seconds_per_step": s}  (a batch of equal-length
                                                         prompts; after the first token)
    {"op": "prefill", "prompt": [ids]}              -> {"seconds": s}            (to the first token)

Greedy, as Kiln's and llama.cpp's runners are. The thread count is the model's genai_config.json
session option, which bench_quant.py writes when it builds the model.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import onnxruntime_genai as og


def generator(model, prompts: list[list[int]], max_length: int):
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=max_length, do_sample=False, batch_size=len(prompts))
    gen = og.Generator(model, params)
    gen.append_tokens(np.asarray(prompts, dtype=np.int32))  # runs the prompts, [batch, length]
    return gen


def main() -> None:
    model = og.Model(sys.argv[1])
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "prefill":
            prompt = request["prompt"]
            start = time.perf_counter()
            generator(model, [prompt], len(prompt) + 1)
            print(json.dumps({"seconds": time.perf_counter() - start}), flush=True)
        else:
            prompts, tokens = request["prompts"], request["tokens"]
            gen = generator(model, prompts, len(prompts[0]) + tokens + 1)
            gen.generate_next_token()  # the first token is the prompts'; time the ones after it
            start = time.perf_counter()
            for _ in range(tokens):
                gen.generate_next_token()
            print(json.dumps({"seconds_per_step": (time.perf_counter() - start) / tokens}), flush=True)


if __name__ == "__main__":
    main()
