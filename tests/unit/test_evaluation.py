"""The build's measures run as the cpu engine runs a graph (builder/measure/evaluation.py): whole, or a layer at a time.
Both must give the token-by-token reference decoder's greedy tokens and logits over chunked prefills, a
layer-at-a-time run must hold one layer's float weights at a time, and the reference's answers come back from
Kiln's cache only for the model, prompts and kernels that decided them."""

from __future__ import annotations

import functools
import weakref

import pytest
import torch
from conftest import exact_plan, make_tiny_llama

from builder.measure import accuracy
from builder.measure.calibration import GraphRunner
from builder.measure.evaluation import LayerRunner, Sequences, WholeRunner, forced_logits, greedy
from builder.sources.lazy_tensors import LazyTensors
from builder.sources import load_model
from builder.planning.plan import Plan
from builder.graph.trace import trace
from passes.canonicalize import canonicalize
from passes.context import PassContext
from passes.quantize_int4 import quantize_int4

PROMPTS = [[1, 5, 9, 13, 2], [7, 7, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [4, 8, 15, 16, 23, 42]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(str(make_tiny_llama(tmp_path_factory.mktemp("eval"), seed=3)))


def float_graph(model, alive: dict | None = None):
    """The traced model, its weights read from the source when used; `alive` counts the float bytes of source
    weights alive at once (its "now" and "most")."""
    graph = trace(model)

    def load(name):
        tensor = model.load(name)
        if alive is not None:
            alive["now"] += tensor.nbytes
            alive["most"] = max(alive["most"], alive["now"])
            weakref.finalize(tensor, lambda n=tensor.nbytes: alive.__setitem__("now", alive["now"] - n))
        return tensor

    graph.tensors = LazyTensors({name: functools.partial(load, name) for name in graph.weights})
    return graph


@pytest.mark.parametrize("runner", [WholeRunner, LayerRunner])
def test_both_runners_give_the_reference_decoders_tokens_and_logits(model, runner):
    graph = float_graph(model)
    reference = GraphRunner(float_graph(model))
    expected = [reference.generate(p, 12, set()) for p in PROMPTS]
    run = runner(graph, Sequences([len(p) + 12 for p in PROMPTS]).blocks)
    assert greedy(run, PROMPTS, 12, set(), step_tokens=8) == expected  # prefills cut into chunks of 8
    rows = [list(range(len(p))) for p in PROMPTS]
    pieces: dict[int, list[torch.Tensor]] = {}
    for index, positions, (logits,) in forced_logits([run], PROMPTS, rows, step_tokens=8):
        pieces.setdefault(index, []).append(logits.clone())
    for index, prompt in enumerate(PROMPTS):
        torch.testing.assert_close(torch.cat(pieces[index]), reference.run(prompt), atol=1e-5, rtol=0)


def test_greedy_stops_after_the_stop_token(model):
    run = WholeRunner(float_graph(model), Sequences([len(p) + 12 for p in PROMPTS]).blocks)
    free = greedy(run, PROMPTS, 12, set())
    stop = {free[0][3]}
    stopped = greedy(run, PROMPTS, 12, stop)
    assert stopped[0] == free[0][:free[0].index(free[0][3]) + 1]
    assert all(s == f[:len(s)] and (len(s) == 12 or s[-1] in stop) for s, f in zip(stopped, free))


def test_a_layer_at_a_time_holds_one_layers_float_weights(model):
    alive = {"now": 0, "most": 0}
    graph = float_graph(model, alive)
    run = LayerRunner(graph, Sequences([len(p) + 4 for p in PROMPTS]).blocks)
    greedy(run, PROMPTS, 4, set())
    weights = {name: model.load(name).nbytes for name in graph.weights}
    layer = max(sum(n for name, n in weights.items() if name.startswith(f"layers.{i}.")) for i in range(4))
    outside = sum(n for name, n in weights.items() if not name.startswith("layers."))
    assert 0 < alive["most"] <= layer + outside < sum(weights.values()) / 2, (alive, layer, outside)

    whole = {"now": 0, "most": 0}
    WholeRunner(float_graph(model, whole), 8)
    assert whole["most"] == sum(weights.values())  # the check can fail: a whole runner holds them all


def test_reference_answers_are_kept_by_what_decides_them(model, tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    run = WholeRunner(float_graph(model), Sequences([len(p) + accuracy.GREEDY_TOKENS for p in PROMPTS]).blocks)
    key = {"model": "sha-of-the-weights", "reference": "float"}
    first = accuracy.reference_answers(run, PROMPTS, set(), key)
    assert len(list(tmp_path.rglob("*.json"))) == 1

    def no_decoding(*args, **kwargs):
        raise AssertionError("decoded again")

    monkeypatch.setattr(accuracy, "greedy", no_decoding)
    assert accuracy.reference_answers(run, PROMPTS, set(), key) == first  # from the cache
    with pytest.raises(AssertionError, match="decoded again"):
        accuracy.reference_answers(run, PROMPTS, set(), dict(key, model="another model"))
    with pytest.raises(AssertionError, match="decoded again"):
        accuracy.reference_answers(run, PROMPTS[:2], set(), key)
    with pytest.raises(AssertionError, match="decoded again"):
        accuracy.reference_answers(run, PROMPTS, set(), None)  # no key: nothing is kept or read


def test_a_table_the_quantized_runner_holds_is_shared_not_read_again(model):
    """A layer-at-a-time reference reads its embedding table from the other runner's copy when both graphs read it
    from the same source call (LazyTensors.reads_as), and from the source when they do not."""
    reads = []
    graph = float_graph(model)
    for name in list(graph.weights):
        load = graph.tensors._loaders[name]
        graph.tensors._loaders[name] = lambda name=name, load=load: reads.append(name) or load()
    table = model.load("embed_tokens.weight")

    def direct():
        return LazyTensors({name: functools.partial(model.load, name) for name in graph.weights})

    assert direct().reads_as("embed_tokens.weight", direct())  # two graphs of one source
    assert not direct().reads_as("embed_tokens.weight", direct(), "lm_head.weight")
    assert not graph.tensors.reads_as("embed_tokens.weight", direct())  # another loader: no proof
    run = LayerRunner(graph, 8, shared={"embed_tokens.weight": table}, same=lambda name: True)
    greedy(run, PROMPTS[:1], 2, set())
    assert "embed_tokens.weight" not in reads and "layers.0.mlp.down_proj.weight" in reads
    reads.clear()
    LayerRunner(graph, 8, shared={"embed_tokens.weight": table})  # no proof they are equal: read once to compare
    assert reads == ["embed_tokens.weight"]


def test_a_spilled_quantized_runner_quantizes_once_and_runs_as_a_whole_one(model, tmp_path):
    """A quantized graph too large to hold runs a layer at a time from a scratch folder: its weights are quantized
    and packed once, not at every step, and it gives the whole runner's answers and logits (and, run exactly, the
    whole runner's exact ones). A float reference reads the table it spilled through a mapping, not the source."""
    reads = []
    graph = float_graph(model)
    for name in list(graph.weights):
        load = graph.tensors._loaders[name]
        graph.tensors._loaders[name] = lambda name=name, load=load: reads.append(name) or load()
    graph = canonicalize(graph, PassContext(plan=Plan()))
    quantized = quantize_int4(graph, PassContext(plan=exact_plan(method="int4", group_size=32), model=model))
    blocks = Sequences([len(p) + 6 for p in PROMPTS]).blocks
    whole = WholeRunner(quantized, blocks, "f16")
    reads.clear()
    spilled = LayerRunner(quantized, blocks, "f16", spill=tmp_path / "spill")
    made = len(reads)
    assert made > 0 and sorted(p.name for p in (tmp_path / "spill").iterdir())[0] == "stage0.pt"
    assert greedy(spilled, PROMPTS, 6, set(), step_tokens=8) == greedy(whole, PROMPTS, 6, set())
    rows = [list(range(len(p))) for p in PROMPTS]
    for (_, _, (a, b)) in forced_logits([spilled, whole], PROMPTS, rows, step_tokens=8):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert greedy(spilled.exact(), PROMPTS, 6, set()) == greedy(whole.exact(), PROMPTS, 6, set())
    assert len(reads) == made  # every step mapped the spilled weights: nothing was read (or quantized) again

    table = spilled.mapped("embed_tokens.weight")
    assert table is not None and table().dtype == torch.float32
    reference = LayerRunner(graph, blocks, shared={"embed_tokens.weight": table}, same=lambda name: True)
    reads.clear()
    greedy(reference, PROMPTS[:1], 2, set())
    assert "embed_tokens.weight" not in reads and "layers.0.mlp.down_proj.weight" in reads
