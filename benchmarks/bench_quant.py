"""Decode and prefill tokens/s of Kiln's float32, INT8, INT4 and FP8 engines beside llama.cpp Q4_0 / Q8_0 and
ONNX Runtime GenAI's int4 CPU model, in one run.

    python benchmarks/bench_quant.py [--model smollm2-135m] [--threads 2] [--decode 64] [--prefill 256]
                                     [--rounds 3] [--engines DIR] [--methods none,int8,int4,fp8,int4:f32]
                                     [--decode-prompt 16] [--batch 1] [--busy-cores N] [--ort-genai PYTHON]

Kiln engines of the model are built with `builder.build.build_engine` into --engines (default: a
temporary directory; an existing directory is reused when its engines are up to date) and run by
runtime.core.engine.LLMEngine. llama.cpp runs the same GGUF requantized to Q4_0 and Q8_0 by its own
`llama_model_quantize` (llama-cpp-python's ctypes API). ONNX Runtime GenAI runs in its own venv
(--ort-genai, default /tmp/venv-ort/bin/python; skipped with a message when absent): its model
builder makes an int4 CPU model (accuracy level 4) of the GGUF converted to a Hugging Face directory,
and benchmarks/ort_genai_worker.py serves it over a pipe. Every configuration is timed once per
round, rounds interleaved, and the best round is reported (the median in brackets): a shared,
noisy machine slows single runs, never speeds them up.

decode tok/s: --batch sequences (default one) decoded together, greedy, --decode tokens each after
--decode-prompt-token prompts (time per step after the first token; the sum over the sequences).
prefill tok/s: one --prefill-token prompt processed in one step, to its first token.
GB/s: bytes of weights read per decode step / time per step (Kiln: every linear and logits
operand, the embedding table counted only when the logits read it; llama.cpp: every tensor but an
untied token embedding).
--busy-cores N: then every configuration again, rounds interleaved, beside N busy-loop processes
pinned to this process's last CPUs; each one's busy speed as a share of its quiet speed (medians).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import statistics
import struct
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

PROMPT_SEED = 0


def kiln_weight_bytes(engine: Path) -> int:
    """Bytes of the weights one decode step reads: linear and logits operands (the rank file's header sizes)."""
    path = engine / "rank0.engine"
    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    program = json.loads(header["__metadata__"]["kiln.program"])
    read = {i for n in program["nodes"] if n["op"] in ("linear", "logits") for i in n["inputs"][1:]}
    return sum(header[n]["data_offsets"][1] - header[n]["data_offsets"][0] for n in read)


def gguf_weight_bytes(path: Path) -> int:
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight")  # untied: the embedding is a row lookup
    return sum(tensors.values())


# ------------------------------------------------------------------------------------------ Kiln

class KilnRunner:
    def __init__(self, engine: Path, threads: int):
        from runtime.core.engine import EngineOptions, LLMEngine

        self.llm = LLMEngine.from_dir(engine, EngineOptions(kv_cache_gib=0.25, num_threads=threads,
                                                             enable_prefix_caching=False))
        self.weight_bytes = kiln_weight_bytes(engine)

    def _params(self, max_tokens: int):
        from runtime.core.sampling import SamplingParams

        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def decode(self, prompts: list[list[int]], tokens: int) -> float:
        """Seconds per decode step of every prompt's sequence at once, after each has its first token."""
        for prompt in prompts:
            self.llm.add_request(prompt, self._params(tokens + 1))
        started: set[str] = set()
        while len(started) < len(prompts):  # the prefill steps (one, unless the prompts outgrow a chunk)
            started.update(o.request_id for o in self.llm.step())
        start = time.perf_counter()
        while self.llm.has_unfinished():
            self.llm.step()
        return (time.perf_counter() - start) / tokens

    def prefill(self, prompt: list[int]) -> float:
        """Seconds to process the prompt (one step)."""
        self.llm.add_request(prompt, self._params(1))
        start = time.perf_counter()
        while self.llm.has_unfinished():
            self.llm.step()
        return time.perf_counter() - start


# ------------------------------------------------------------------------------------------ llama.cpp

@contextlib.contextmanager
def quiet_stderr():
    """Silence what C code writes to fd 2 (llama.cpp logs every tensor it quantizes)."""
    saved = os.dup(2)
    with open(os.devnull, "wb") as devnull:
        os.dup2(devnull.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def llama_cpp_quantize(source: Path, out: Path, ftype: int, threads: int) -> Path:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread, params.allow_requantize = ftype, threads, True
    with quiet_stderr():
        status = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params))
    if status != 0:
        raise RuntimeError(f"llama_model_quantize failed for {out.name}")
    return out


class LlamaCppRunner:
    def __init__(self, path: Path, threads: int, context: int):
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=context, n_batch=context, n_ubatch=context,
                                   n_threads=threads, n_threads_batch=threads, verbose=False)
        self.weight_bytes = gguf_weight_bytes(path)
        self.threads, self.context, self.batched = threads, context, {}

    def next_token(self) -> int:
        """Greedy, as Kiln's sampler: the argmax of the last evaluated position's logits. They are read
        from llama.cpp's context (llama_get_logits_ith): llama-cpp-python 0.3.36's eval() leaves
        `.scores` at zero, whose argmax would feed token 0 back every step."""
        import llama_cpp

        logits = llama_cpp.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return int(np.ctypeslib.as_array(logits, shape=(self.llm.n_vocab(),)).argmax())

    def decode(self, prompts: list[list[int]], tokens: int) -> float:
        if len(prompts) > 1:
            return self.decode_batched(prompts, tokens)
        self.llm.reset()
        self.llm.eval(prompts[0])
        token = self.next_token()
        start = time.perf_counter()
        for _ in range(tokens):
            self.llm.eval([token])
            token = self.next_token()
        return (time.perf_counter() - start) / tokens

    def decode_batched(self, prompts: list[list[int]], tokens: int) -> float:
        """Every prompt a sequence of one llama_batch, prefilled together, then one token each per
        llama_decode: llama.cpp's own batched decoding (the Llama class runs one sequence), through a
        context of its own with a sequence slot per prompt."""
        import llama_cpp

        n = len(prompts)
        if n not in self.batched:
            params = llama_cpp.llama_context_default_params()
            params.n_ctx, params.n_seq_max = self.context * n, n
            params.n_batch = params.n_ubatch = max(sum(map(len, prompts)), n)
            params.n_threads = params.n_threads_batch = self.threads
            with quiet_stderr():
                ctx = llama_cpp.llama_init_from_model(self.llm._model.model, params)
            if not ctx:
                raise RuntimeError(f"llama.cpp could not make a context for {n} sequences")
            self.batched[n] = (ctx, llama_cpp.llama_batch_init(params.n_batch, 0, n))
        ctx, batch = self.batched[n]
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)

        def run(entries: list[tuple[int, int, int, bool]]) -> list[int]:
            """(token, position, sequence, wants logits) each; the greedy next token of each that wants them."""
            batch.n_tokens = len(entries)
            for i, (token, pos, seq, logits) in enumerate(entries):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
                batch.seq_id[i][0] = seq
            if llama_cpp.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            vocab = self.llm.n_vocab()
            return [int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(vocab,)).argmax())
                    for i, entry in enumerate(entries) if entry[3]]

        last = run([(t, pos, seq, pos == len(p) - 1) for seq, p in enumerate(prompts) for pos, t in enumerate(p)])
        start = time.perf_counter()
        for step in range(tokens):
            last = run([(t, len(p) + step, seq, True) for seq, (t, p) in enumerate(zip(last, prompts))])
        return (time.perf_counter() - start) / tokens

    def prefill(self, prompt: list[int]) -> float:
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(prompt)
        self.next_token()
        return time.perf_counter() - start


# ------------------------------------------------------------------------------------------ ONNX Runtime GenAI

DEFAULT_ORT_PYTHON = "/tmp/venv-ort/bin/python"  # python -m venv /tmp/venv-ort && /tmp/venv-ort/bin/pip install
                                                 # onnxruntime-genai onnxruntime torch==2.13.0 transformers onnx onnx_ir


def build_ort_genai(python: str, gguf: Path, out: Path, threads: int) -> Path:
    """ONNX Runtime GenAI's int4 CPU model of the GGUF (converted to a Hugging Face directory first), by its own
    model builder (MatMulNBits, accuracy level 4: int8 activations, its CPU recipe), with `threads` threads."""
    if not (out / "genai_config.json").exists():
        from bench_serving import hf_directory

        hf_dir = hf_directory(str(gguf), out.with_name(out.name + "-hf"))
        print(f"  building the ONNX Runtime GenAI int4 model into {out} ...", flush=True)
        built = subprocess.run([python, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(out),
                                "-p", "int4", "-e", "cpu", "-c", str(out.with_name(out.name + "-cache")),
                                "--extra_options", "int4_accuracy_level=4"], capture_output=True, text=True, check=False)
        if built.returncode != 0:
            raise RuntimeError(f"onnxruntime_genai's model builder failed: {built.stderr.strip()[-2000:]}")
    config_path = out / "genai_config.json"
    config = json.loads(config_path.read_text())
    config["model"]["decoder"].setdefault("session_options", {})["intra_op_num_threads"] = threads
    config_path.write_text(json.dumps(config, indent=4))
    return out


class OrtGenaiRunner:
    """ONNX Runtime GenAI in its own venv, behind a pipe (benchmarks/ort_genai_worker.py)."""

    def __init__(self, python: str, model_dir: Path):
        worker = Path(__file__).with_name("ort_genai_worker.py")
        self.process = subprocess.Popen([python, str(worker), str(model_dir)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        self._answer()
        self.weight_bytes = sum(f.stat().st_size for f in model_dir.glob("*.onnx*"))

    def _answer(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the ONNX Runtime GenAI worker exited (status {self.process.wait()})")
        return json.loads(line)

    def _ask(self, **request) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._answer()

    def decode(self, prompts: list[list[int]], tokens: int) -> float:
        return self._ask(op="decode", prompts=prompts, tokens=tokens)["seconds_per_step"]

    def prefill(self, prompt: list[int]) -> float:
        return self._ask(op="prefill", prompt=prompt)["seconds"]


# ------------------------------------------------------------------------------------------ the run

def build_kiln(model: str, method: str, engines: Path):
    """`method` is a [quant] method, optionally with "+head" (the logits and embedding weights requantized too,
    nothing excluded) and ":f32", ":int16", ":int12" or ":int8" for the activations (default: the plan's, f32)."""
    from builder.build import build_engine
    from builder.planning.plan import load_plan

    name, _, activations = method.partition(":")
    name, head, _ = name.partition("+head")
    overrides = {"method": name, "activations": activations or None}
    if head:
        overrides["exclude"] = []
    plan = load_plan().with_overrides("quant", **overrides)
    out = engines / f"kiln-{method.replace(':', '-act').replace('+', '-')}"
    start = time.perf_counter()
    result = build_engine(model, plan, out, force=True, show_progress=False)
    print(f"  kiln {method:8s} {'up to date' if result.up_to_date else 'built'} in "
          f"{time.perf_counter() - start:5.1f} s", flush=True)
    return out, result.manifest.get("accuracy", {})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--model", default="smollm2-135m", help="preset or .gguf path (llama.cpp needs a GGUF)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode", type=int, default=64, help="decode tokens per measurement")
    parser.add_argument("--prefill", type=int, default=256, help="prompt tokens of the prefill measurement")
    parser.add_argument("--decode-prompt", type=int, default=16, help="prompt tokens before the decode measurement")
    parser.add_argument("--batch", type=int, default=1,
                        help="sequences decoded together in the decode measurement (decode tok/s is their sum)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engines", type=Path, default=None, help="directory for the engines (reused if current)")
    parser.add_argument("--methods", default="none,int8,int4,fp8,int4:f32",
                        help="Kiln [quant] methods to build and run; METHOD+head also requantizes the logits "
                             "(and tied embedding) weights; METHOD:f32, :int16, :int12 or :int8 sets the activations "
                             "(default: the plan's, auto: the fastest path the build allowed on this host)")
    parser.add_argument("--busy-cores", type=int, default=0,
                        help="then time every engine again beside this many busy-loop processes pinned to this "
                             "process's last CPUs, and print each one's share of its quiet speed")
    parser.add_argument("--ort-genai", default=DEFAULT_ORT_PYTHON, metavar="PYTHON",
                        help="the Python of a venv with onnxruntime-genai (its int4 CPU model runs beside; skipped "
                             "with a message when it is not there)")
    args = parser.parse_args()

    from builder.sources import load_model

    torch.set_num_threads(args.threads)
    source = Path(load_model(args.model).source)
    tmp = tempfile.TemporaryDirectory(prefix="bench_quant.")
    engines = args.engines or Path(tmp.name)
    engines.mkdir(parents=True, exist_ok=True)
    print(f"model {args.model} ({source.name}), {args.threads} threads; building into {engines}; "
          f"load average {os.getloadavg()[0]:.1f} (a shared machine: compare within one run)", flush=True)

    runners, accuracy = {}, {}
    for method in args.methods.split(","):
        path, accuracy[f"kiln {method}"] = build_kiln(args.model, method, engines)
        runners[f"kiln {method}"] = KilnRunner(path, args.threads)
    context = max(args.prefill, args.decode_prompt) + args.decode + 64
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama.cpp skipped: llama-cpp-python is not installed (pip install -e \".[bench]\")", flush=True)
    else:
        for name, ftype in (("Q4_0", 2), ("Q8_0", 7)):
            quantized = engines / f"{source.stem}.{name}.gguf"
            if not quantized.exists():
                llama_cpp_quantize(source, quantized, ftype, args.threads)
            runners[f"llama.cpp {name}"] = LlamaCppRunner(quantized, args.threads, context)
    if Path(args.ort_genai).exists():
        model = build_ort_genai(args.ort_genai, source, engines / "ort-genai-int4", args.threads)
        runners["ORT GenAI int4"] = OrtGenaiRunner(args.ort_genai, model)
    else:
        print(f"ONNX Runtime GenAI skipped: no {args.ort_genai} (--ort-genai PYTHON; the venv's two install "
              "commands are beside DEFAULT_ORT_PYTHON in this script)", flush=True)

    rng = np.random.default_rng(PROMPT_SEED)
    vocab = min(load_model(args.model).config.vocab_size, 32000)
    short = [rng.integers(100, vocab, args.decode_prompt).tolist() for _ in range(args.batch)]
    long = rng.integers(100, vocab, args.prefill).tolist()
    decode, prefill = time_rounds(runners, args, short, long)

    print(f"\nload average {os.getloadavg()[0]:.1f}; best of {args.rounds} rounds [median]; decode of "
          f"{args.batch} sequence{'s' if args.batch > 1 else ''}")
    print(f"{'engine':18s} {'decode tok/s':>20s} {'GB/s':>6s} {'weights MB':>10s} {'prefill tok/s':>20s}  ppl (+%)")
    for name, runner in runners.items():
        best, median = min(decode[name]), statistics.median(decode[name])
        p_best, p_median = min(prefill[name]), statistics.median(prefill[name])
        acc = accuracy.get(name) or {}
        ppl = f"{acc['ppl_quantized']:.3f} ({acc['ppl_increase_pct']:+.2f}%)" if "ppl_quantized" in acc else ""
        print(f"{name:18s} {args.batch / best:9.1f} [{args.batch / median:7.1f}] {runner.weight_bytes / best / 1e9:6.2f} "
              f"{runner.weight_bytes / 1e6:10.1f} {args.prefill / p_best:9.1f} [{args.prefill / p_median:7.1f}]  {ppl}")
    if args.busy_cores:
        busy_beside(runners, args, short, long, decode, prefill)


def time_rounds(runners: dict, args, short: list[int], long: list[int]) -> tuple[dict, dict]:
    """Seconds per decode step and per prefill of every runner, `args.rounds` times, runners interleaved."""
    decode = {name: [] for name in runners}
    prefill = {name: [] for name in runners}
    for _ in range(args.rounds):
        for name, runner in runners.items():
            time.sleep(SETTLE_SECONDS)
            decode[name].append(runner.decode(short, args.decode))
            prefill[name].append(runner.prefill(long))
    return decode, prefill


# Idle time before each engine's turn, so that the worker threads of the engine before it (OpenMP's spin after its
# last kernel, ONNX Runtime's intra-op pool) have gone to sleep and share no core with the next one's timing.
SETTLE_SECONDS = 0.5


def busy_beside(runners: dict, args, short: list[int], long: list[int], decode: dict, prefill: dict) -> None:
    """Every engine timed again, interleaved, while busy loops hold `args.busy_cores` of this process's CPUs."""
    from runtime.measure.bench import BusyCores

    with BusyCores(args.busy_cores) as spinning:
        print(f"\nbusy loops pinned to CPUs {spinning.cpus}; load average {os.getloadavg()[0]:.1f}", flush=True)
        busy_decode, busy_prefill = time_rounds(runners, args, short, long)
    print(f"load average {os.getloadavg()[0]:.1f}; medians of {args.rounds} rounds, quiet -> busy")
    print(f"{'engine':18s} {'decode tok/s':>22s} {'share':>6s} {'prefill tok/s':>22s} {'share':>6s}")
    for name in runners:
        quiet_d, busy_d = statistics.median(decode[name]), statistics.median(busy_decode[name])
        quiet_p, busy_p = statistics.median(prefill[name]), statistics.median(busy_prefill[name])
        print(f"{name:18s} {args.batch / quiet_d:9.1f} -> {args.batch / busy_d:9.1f} {100 * quiet_d / busy_d:5.0f}% "
              f"{args.prefill / quiet_p:9.1f} -> {args.prefill / busy_p:9.1f} {100 * quiet_p / busy_p:5.0f}%")


if __name__ == "__main__":
    main()
