"""Calibration and evaluation data: the shipped texts, their tokens, a whole-graph reference runner (GraphRunner) and
the layer-at-a-time sweep the calibration passes capture activations with (LayerSweep).

Texts are read as token windows of at most WINDOW tokens (or the model's context, if shorter),
each run as one independent sequence that starts as a user's raw prompt would: with the model's BOS
where its tokenizer adds one (runtime/format/special_tokens.py), and so are the chat prompts.
"""

from __future__ import annotations

import copy
import functools
import json
import tempfile
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path

import torch

from builder.errors import KilnError
from builder.graph.cuts import layer_stages
from builder.graph.ir import Graph
from builder.quant.packing import pack_graph
from runtime.backends.activations import with_activations
from runtime.core.chat import render_chat
from runtime.format.special_tokens import SpecialTokens
from runtime.ops import reference
from runtime.ops.program import Program, dense_hooks

WINDOW = 512
MAX_TOKENS = 1024          # calibration and evaluation read at most this many tokens
MIN_CALIBRATION_TOKENS = 256
MAX_CAPTURED_ROWS = 512    # activation rows kept per value by LayerSweep.run (evenly spaced)
KV_EMULATION = {"bf16": torch.bfloat16, "f16": torch.float16}
KV_MAX = {"int8": 127.0, "fp8": 448.0}


def shipped_text(name: str) -> str:
    """builder/data/<name>.txt without its header line (which names the source)."""
    text = (resources.files("builder") / "data" / f"{name}.txt").read_text(encoding="utf-8")
    return text.split("\n", 1)[1] if text.startswith("#") else text


def tokenize(model, text: str) -> list[int]:
    """A text's token ids without special tokens (the windows add them)."""
    tokenizer, _, _ = model_tokenizer(model)
    return tokenizer.encode(text, add_special_tokens=False).ids


@functools.lru_cache(maxsize=4)
def model_tokenizer(model):
    """The model's tokenizer, its tokenizer_config (chat template, special tokens) and the special tokens
    it puts around a raw text, as the engine will (written out once per model: a GGUF's takes seconds)."""
    from tokenizers import Tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        model.write_tokenizer(tmp)
        config = json.loads(Path(tmp, "tokenizer_config.json").read_text(encoding="utf-8"))
        tokenizer = Tokenizer.from_file(f"{tmp}/tokenizer.json")
    try:
        special = model.special_tokens(config, tokenizer)
    except ValueError as exc:
        raise KilnError(f"model: {model.source}: {exc}") from None
    return tokenizer, config, special


def chat_prompts(model) -> tuple[list[list[int]], bool]:
    """The shipped chat prompts as the server sends them (each one user message through the model's chat
    template, with the special tokens the server adds), and whether there was a template to use; without
    one, the bare messages as raw prompts."""
    tokenizer, config, special = model_tokenizer(model)
    messages = [line for line in shipped_text("chat_prompts").splitlines() if line.strip()]
    templated = bool(config.get("chat_template"))
    texts = [render_chat(config, [{"role": "user", "content": m}]) if templated else m for m in messages]
    return [special.apply(e.ids) for e in tokenizer.encode_batch(texts, add_special_tokens=False)], templated


def windows(ids: list[int], max_positions: int, special: SpecialTokens = SpecialTokens()) -> list[list[int]]:
    """Windows of a text's ids (of at most WINDOW and the model's max_positions tokens), each with the special
    tokens a raw prompt gets."""
    length = min(WINDOW, max_positions) - len(special.prefix) - len(special.suffix)
    ids = ids[:MAX_TOKENS]
    return [special.apply(ids[i:i + length]) for i in range(0, len(ids), length) if len(ids[i:i + length]) > 1]


def calibration_windows(ctx, purpose: str) -> list[list[int]]:
    """Token windows of the calibration text (--calib, else the shipped one); one-line error if too short."""
    if ctx.model is None:
        raise KilnError(f"{purpose}: calibration needs the model source (its tokenizer)")
    text = ctx.calibration_text if ctx.calibration_text is not None else shipped_text("calibration")
    tokenizer, _, special = model_tokenizer(ctx.model)
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if len(ids) < MIN_CALIBRATION_TOKENS:
        raise KilnError(f"calibration text too short for {purpose}: {len(ids)} tokens, at least "
                        f"{MIN_CALIBRATION_TOKENS} needed (about {MIN_CALIBRATION_TOKENS * 5 // 1000 + 1} KB of prose)")
    return windows(ids, ctx.model.config.max_position_embeddings, special)


def evaluation_windows(ctx) -> list[list[int]]:
    text = ctx.evaluation_text if ctx.evaluation_text is not None else shipped_text("evaluation")
    _, _, special = model_tokenizer(ctx.model)
    return windows(tokenize(ctx.model, text), ctx.model.config.max_position_embeddings, special)


def fake_quantize_kv(x: torch.Tensor, kv_dtype: str, kv_scale: float) -> torch.Tensor:
    """What a cache of `kv_dtype` gives back for x (as the C kv_write/paged_attention round it)."""
    if kv_dtype == "int8":
        return torch.round(x / kv_scale).clamp(-127, 127) * kv_scale
    if kv_dtype == "fp8":
        return (x / kv_scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * kv_scale
    if kv_dtype in KV_EMULATION:
        return x.to(KV_EMULATION[kv_dtype]).float()
    return x


class GraphRunner:
    """Runs a whole single-rank graph over one sequence (dense causal attention, no cache).

    Logical quantized operands are packed first, so the kernels are the executor's; with the plan's
    `activations` int8 or int16, eligible layers run that integer path. With a kv_dtype other than
    f32, K and V are rounded as that cache type would store them. run(ids, exact=True) runs the same
    packed weights in float32 (f32 activations and KV): the reference of a graph that is not
    requantized, without a second copy of the model. generate() decodes greedily, a token a step,
    over a per-layer cache of K and V (the rounded values, as the engine's cache holds them).
    """

    def __init__(self, graph: Graph, kv_dtype: str = "f32", activations: str = "f32"):
        runnable = pack_graph(graph, "f32")
        self._bind(json.loads(runnable.to_json()), runnable.tensors, kv_dtype, activations)

    @classmethod
    def from_program(cls, doc: dict, tensors: dict[str, torch.Tensor], kv_dtype: str = "f32",
                     activations: str = "f32") -> GraphRunner:
        """A runner of a packed program (a rank file's): its nodes' own `act` choices are dropped."""
        runner = cls.__new__(cls)
        runner._bind(with_activations(doc, "f32"), tensors, kv_dtype, activations)
        return runner

    def _bind(self, doc: dict, tensors: dict[str, torch.Tensor], kv_dtype: str, activations: str) -> None:
        hooks = dense_hooks(self._attention, all_logits=True)
        self.kv_dtype = self._kv_now = kv_dtype
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None  # layer -> (K, V) in generate()
        self.exact_program = Program(doc, tensors, hooks)
        self.program = self.exact_program
        integer = with_activations(doc, activations)
        if integer != doc:
            self.program = Program(integer, tensors, hooks)
        self.last_use: dict[str, int] = {}
        for index, call in enumerate(self.program.calls):
            for name in call.inputs:
                self.last_use[name] = index

    def _attention(self, attrs: dict):
        scale = attrs.get("kv_scale", 1.0)

        def run(q, k, v):
            k, v = fake_quantize_kv(k, self._kv_now, scale), fake_quantize_kv(v, self._kv_now, scale)
            if self._cache is None:
                return reference.dense_causal_attention(q, k, v, attrs)
            if attrs["layer"] in self._cache:
                past_k, past_v = self._cache[attrs["layer"]]
                k, v = torch.cat([past_k, k]), torch.cat([past_v, v])
            self._cache[attrs["layer"]] = (k, v)
            return reference.dense_causal_attention(q, k, v, attrs)

        return run

    @torch.inference_mode()
    def run(self, ids: list[int], capture: Callable[[str, torch.Tensor], None] | None = None,
            wanted: set[str] | None = None, exact: bool = False) -> torch.Tensor | None:
        """[T, vocab] logits; or, with `wanted`, call capture(name, value) for each and stop after the last."""
        env = {"tokens": torch.tensor(ids, dtype=torch.int64), "positions": torch.arange(len(ids))}
        remaining = set(wanted or ())
        program = self.exact_program if exact else self.program
        self._kv_now = "f32" if exact else self.kv_dtype

        def observe(index: int, call, env: dict) -> bool:
            for name in call.outputs:
                if name in remaining:
                    capture(name, env[name])
                    remaining.discard(name)
            if wanted is not None and not remaining:
                return True
            for name in call.inputs:  # free activations no later call reads
                if self.last_use.get(name) == index:
                    env.pop(name, None)
            return False

        outputs = program.run(env, observe)
        return None if wanted is not None else outputs[0]

    @torch.inference_mode()
    def generate(self, ids: list[int], max_new: int, stop: set[int], exact: bool = False) -> list[int]:
        """The greedy continuation of `ids`: up to max_new tokens, ending after the first token in `stop`."""
        program = self.exact_program if exact else self.program
        self._kv_now = "f32" if exact else self.kv_dtype
        self._cache, out, step = {}, [], ids
        try:
            while len(out) < max_new and not (out and out[-1] in stop):
                start = len(ids) + len(out) - len(step)
                env = {"tokens": torch.tensor(step, dtype=torch.int64), "positions": torch.arange(start, start + len(step))}
                out.append(int(program.run(env, release=True)[0][-1].argmax()))
                step = out[-1:]
        finally:
            self._cache = None
        return out


def progress(items, desc: str, unit: str, show: bool, total: int | None = None):
    """A pass's own progress bar under the pipeline's (cleared when done), or the items as they are."""
    if not show:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=f"  {desc}", unit=unit, leave=False, total=total)


class LayerSweep:
    """Token windows run through a single-rank graph a layer at a time, for the calibration passes.

    The graph is cut as the layer-at-a-time evaluation cuts it (builder/graph/cuts.py: one stage a layer, the first with
    the embedding, the last with the head), and each window's values crossing the current cut are kept (a few
    tokens' hidden states: MBs). A stage's weights are read from the graph's tensors each time it runs (a streaming
    build's: from the model source, through whatever the pass has derived so far) and let go after, so one layer's
    float weights are resident whatever the model's size, where running the whole graph held the whole float model.
    The values a stage computes are those of a whole-graph run (same kernels, same inputs), and a pass that changes
    a layer's weights after its stage ran (AWQ's folds and clips, GPTQ's rounding) changes what later stages see.

        sweep = LayerSweep(graph, windows)
        for stage in sweep:                      # each stage in order
            captured = sweep.run(wanted, ...)    # as often as the pass needs, weights overridden if it likes
            sweep.run(set(), advance=True)       # the last run of a stage hands its values to the next
    """

    def __init__(self, graph: Graph, token_windows: list[list[int]], desc: str = "calibration",
                 show_progress: bool = False):
        self.graph, self.windows, self.desc, self.show_progress = graph, token_windows, desc, show_progress
        self.stages = layer_stages(graph)  # their structure; each run binds the graph's tensors as they are then
        self.made = {o: index for index, stage in enumerate(self.stages) for n in stage.nodes if n.op != "recv"
                     for o in n.outputs}
        self.index = 0
        self._carried: list[list[torch.Tensor]] = [[] for _ in token_windows]  # values entering the current stage

    def __len__(self) -> int:
        return len(self.stages)

    def __iter__(self) -> Iterator[int]:
        for index in progress(range(len(self.stages)), self.desc, "layer", self.show_progress):
            yield index
            if self.index != index + 1:
                raise RuntimeError(f"{self.desc}: stage {index} was not advanced (run(..., advance=True))")

    def stage_of(self, name: str) -> int:
        """The stage whose nodes compute value `name`."""
        return self.made[name]

    @torch.inference_mode()
    def run(self, wanted: set[str], overrides: dict[str, torch.Tensor] | None = None, advance: bool = False,
            max_rows: int | None = MAX_CAPTURED_ROWS) -> dict[str, torch.Tensor]:
        """The current stage over every window: name -> [rows, width] of each wanted value it computes (every
        window's rows, at most max_rows evenly spaced; None: all). overrides: weights read instead of the graph's
        for this run. advance: keep the values crossing to the next stage and move the sweep on to it."""
        stage = self.stages[self.index].replace()
        stage.tensors = copy.copy(self.graph.tensors)
        stage.tensors.update(overrides or {})
        packed = pack_graph(stage, "f32")
        handing = advance and self.index + 1 < len(self.stages)
        hooks = dense_hooks(all_logits=True)
        box: dict[str, list[torch.Tensor]] = {"in": [], "out": []}
        hooks.recv = lambda attrs: box["in"].pop(0)
        hooks.send = lambda x, attrs: box["out"].append(x)
        program = Program(json.loads(packed.to_json()), packed.tensors, hooks)
        del packed
        last_use = {name: index for index, call in enumerate(program.calls) for name in call.inputs}
        wanted = {name for name in wanted if self.made.get(name) == self.index}
        chunks: dict[str, list[torch.Tensor]] = {name: [] for name in wanted}
        handed = []
        for window, carried in zip(self.windows, self._carried):
            box["in"], box["out"] = list(carried), []
            remaining = set(wanted)

            def observe(index: int, call, env: dict) -> bool:
                for name in call.outputs:
                    if name in remaining:
                        chunks[name].append(env[name].clone())
                        remaining.discard(name)
                if not remaining and not handing:
                    return True
                for name in call.inputs:  # free activations no later call reads
                    if last_use.get(name) == index:
                        env.pop(name, None)
                return False

            program.run({"tokens": torch.tensor(window, dtype=torch.int64),
                         "positions": torch.arange(len(window))}, observe)
            handed.append(box["out"])
        if advance:
            self._carried = handed if handing else [[] for _ in self.windows]
            self.index += 1
        return {name: _evenly_spaced(torch.cat(parts), max_rows) for name, parts in chunks.items()}


def sweep_max_abs(graph: Graph, names: set[str], token_windows: list[list[int]], desc: str,
                  show_progress: bool = False) -> dict[str, float]:
    """name -> max |value| over the windows (0 for a value never computed), a layer at a time."""
    amax = dict.fromkeys(names, 0.0)
    sweep = LayerSweep(graph, token_windows, desc, show_progress)
    for _ in sweep:
        for name, rows in sweep.run(names, advance=True, max_rows=None).items():
            amax[name] = float(rows.abs().max())
    return amax


def _evenly_spaced(rows: torch.Tensor, max_rows: int | None) -> torch.Tensor:
    return rows if max_rows is None else rows[:: max(1, -(-rows.shape[0] // max_rows))]
