"""Sharding: Mapping, the tensor-parallel and pipeline passes before/after, parity of the rank programs
run together in one process (threads stand in for ranks), rank file sizes, and bad plans."""

import functools
import json
import queue
import threading

import pytest
import torch

from builder.build import build_engine
from builder.errors import KilnError
from builder.graph.ir import verify
from builder.sources.lazy_tensors import LazyTensors
from runtime.format.mapping import Mapping, Span, balanced_stages
from builder.sources import load_model
from builder.pipeline import build_pipeline, run_pipeline
from builder.planning.plan import Plan
from builder.graph.trace import trace
from conftest import exact_plan
from passes.canonicalize import canonicalize
from passes.context import PassContext
from passes.fuse_gate_up import fuse_gate_up
from passes.fuse_qkv import fuse_qkv
from passes.quantize_int4 import quantize_int4
from passes.shard_tensor_parallel import shard_tensor_parallel
from passes.split_pipeline_stages import split_pipeline_stages
from runtime.ops import reference
from runtime.ops.program import Hooks, Program

IDS = [1, 5, 9, 2, 77, 31, 100, 200, 3, 41]


def traced(model_dir):
    model = load_model(str(model_dir))
    graph = trace(model)
    graph.tensors = LazyTensors({name: functools.partial(model.load, name) for name in graph.weights})
    return canonicalize(graph, PassContext(plan=Plan())), model


def plan(tp=1, pp=1, ep=1, **quant):
    return exact_plan(**{"method": "none", **quant}).with_overrides(tp=tp, pp=pp, ep=ep)


def rank_graphs(model_dir, tp=1, pp=1, ep=1, **quant):
    graph, model = traced(model_dir)
    # A short evaluation text: measure_accuracy's perplexity of a quantized build is not under test here.
    ctx = PassContext(plan=plan(tp, pp, ep, **quant), model=model, evaluation_text="The quick brown fox. " * 4)
    return run_pipeline(graph, ctx, build_pipeline(ctx.plan))


def ops(graph, prefix):
    return [(n.op, n.name) for n in graph.nodes if n.name.startswith(prefix)]


def node(graph, name):
    return next(n for n in graph.nodes if n.name == name)


# ---------------------------------------------------------------------------- Mapping

def test_mapping_numbers_ranks_stage_major():
    m = Mapping(tp=2, pp=2, rank=3)
    assert (m.tp_rank, m.pp_rank, m.world_size) == (1, 1, 4)
    assert m.tp_group() == [2, 3] and m.pp_group() == [1, 3]
    assert m.is_last_pp_rank() and not m.is_first_pp_rank() and m.prev_pp_rank() == 1
    assert Mapping(tp=2, pp=3, rank=0).tp_groups() == [[0, 1], [2, 3], [4, 5]]


def test_mapping_splits_whole_kv_groups_and_replicates_kv_heads_beyond_them():
    shares = lambda tp: [Mapping(tp, 1, r).attention_heads(9, 3) for r in range(tp)]  # noqa: E731
    assert [(s.q, s.kv) for s in shares(2)] == [(Span(0, 6), Span(0, 2)), (Span(6, 3), Span(2, 1))]
    # 4 ranks, 3 KV heads: ranks 0 and 1 share KV head 0 and split its 3 query heads 2 + 1.
    assert [(s.q, s.kv) for s in shares(4)] == [(Span(0, 2), Span(0, 1)), (Span(2, 1), Span(0, 1)),
                                                (Span(3, 3), Span(1, 1)), (Span(6, 3), Span(2, 1))]
    with pytest.raises(ValueError, match="tp=10: more ranks than the model's 9 attention heads"):
        Mapping(10, 1, 0).attention_heads(9, 3)


def test_pp_layers_balance_cost_with_embedding_first_and_logits_last():
    assert balanced_stages([1.0] * 8, 2) == [0, 4, 8]
    assert balanced_stages([1.0] * 8, 2, first_cost=0.0, last_cost=2.0) == [0, 5, 8]
    assert [list(Mapping(1, 3, r).pp_layers(7)) for r in range(3)] == [[0, 1], [2, 3], [4, 5, 6]]
    with pytest.raises(ValueError, match="pp=5: more stages than the model's 4 layers"):
        Mapping(1, 5, 0).pp_layers(4)


# ---------------------------------------------------------------------------- the passes, before/after

def test_tensor_parallel_pass_on_uneven_heads(tiny_llama_uneven_dir):
    before, _ = traced(tiny_llama_uneven_dir)  # 9 query / 3 KV heads of 16, hidden 144, MLP 192, vocab 320
    after = shard_tensor_parallel(before, PassContext(plan=Plan(tp=2), rank=1))
    verify(after)
    assert ops(after, "layers.0.self_attn") == [
        ("linear", "layers.0.self_attn.q_proj"), ("linear", "layers.0.self_attn.k_proj"),
        ("rope", "layers.0.self_attn.rope"), ("linear", "layers.0.self_attn.v_proj"),
        ("attention", "layers.0.self_attn.attn"), ("linear", "layers.0.self_attn.o_proj"),
        ("all_reduce", "layers.0.self_attn.o_proj.all_reduce")]
    assert ops(after, "layers.0.mlp.")[-2:] == [("linear", "layers.0.mlp.down_proj"),
                                               ("all_reduce", "layers.0.mlp.down_proj.all_reduce")]
    shapes = {name: after.weights[f"layers.0.{name}.weight"].shape for name in
              ("self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj")}
    assert shapes == {"self_attn.q_proj": (48, 144), "self_attn.k_proj": (16, 144), "self_attn.o_proj": (144, 48),
                      "mlp.up_proj": (96, 144), "mlp.down_proj": (144, 96)}
    attn = node(after, "layers.0.self_attn.attn").attrs
    assert (attn["num_heads"], attn["num_kv_heads"]) == (3, 1)
    embed = node(after, "embed_tokens").attrs
    assert (embed["vocab_start"], embed["vocab_size"], embed["full_vocab_size"]) == (160, 160, 320)
    assert [n.op for n in after.nodes[-2:]] == ["logits", "all_gather"]
    assert after.nodes[-1].attrs == {"group": "tp", "sizes": [160, 160]}
    assert after.values["logits"].shape == ("N", 320) and after.values["logits.shard"].shape == ("N", 160)
    assert after.meta["shard"] == {"tp_rank": 1, "q_heads": [6, 3], "kv_heads": [2, 1], "intermediate": [96, 96],
                                   "vocab": [160, 160]}
    # Rank 1 holds query rows of heads 6..8 and the input columns of o_proj that read them.
    torch.testing.assert_close(after.tensors["layers.0.self_attn.q_proj.weight"],
                               before.tensors["layers.0.self_attn.q_proj.weight"][96:144], rtol=0, atol=0)
    torch.testing.assert_close(after.tensors["layers.0.self_attn.o_proj.weight"],
                               before.tensors["layers.0.self_attn.o_proj.weight"][:, 96:144], rtol=0, atol=0)


def test_tensor_parallel_pass_keeps_each_part_of_fused_linears(tiny_llama_uneven_dir):
    before, _ = traced(tiny_llama_uneven_dir)
    fused = fuse_gate_up(fuse_qkv(before, None), None)
    after = shard_tensor_parallel(fused, PassContext(plan=Plan(tp=2), rank=1))
    verify(after)
    assert node(after, "layers.0.self_attn.qkv_split").attrs["sizes"] == [48, 16, 16]
    w = {n: before.tensors[f"layers.0.{n}.weight"] for n in ("self_attn.q_proj", "self_attn.k_proj",
                                                             "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")}
    torch.testing.assert_close(after.tensors["layers.0.self_attn.qkv_proj.weight"], torch.cat(
        [w["self_attn.q_proj"][96:], w["self_attn.k_proj"][32:], w["self_attn.v_proj"][32:]]), rtol=0, atol=0)
    torch.testing.assert_close(after.tensors["layers.0.mlp.gate_up_proj.weight"],
                               torch.cat([w["mlp.gate_proj"][96:], w["mlp.up_proj"][96:]]), rtol=0, atol=0)


def test_pipeline_pass_cuts_layers_with_send_and_recv(tiny_llama_dir):
    before, _ = traced(tiny_llama_dir)  # 4 layers
    first, last = (split_pipeline_stages(before, PassContext(plan=Plan(pp=2), rank=r)) for r in (0, 1))
    for g in (first, last):
        verify(g)
    assert first.nodes[0].op == "embedding" and first.outputs == []
    assert [(n.op, n.inputs, n.attrs) for n in first.nodes[-1:]] == [("send", ["layers.1.mlp_residual"], {"dst": 1})]
    assert not any(n.name.startswith(("layers.2.", "layers.3.")) for n in first.nodes)
    assert [(n.op, n.outputs, n.attrs) for n in last.nodes[:1]] == [
        ("recv", ["layers.1.mlp_residual"], {"src": 0, "dtype": "f32", "shape": ["T", 64]})]
    assert last.outputs == ["logits"] and last.nodes[-1].op == "logits"
    assert [n.attrs["layer"] for n in last.nodes if n.op == "attention"] == [0, 1]  # this rank's KV cache slots
    assert "embed_tokens.weight" not in last.weights and "lm_head.weight" not in first.weights
    assert (first.meta["stage"], last.meta["stage"]) == ({"pp_rank": 0, "layers": [0, 2]},
                                                         {"pp_rank": 1, "layers": [2, 4]})


# ---------------------------------------------------------------------------- rank programs run together

class ThreadRanks:
    """Every rank's program in a thread of this process; collectives over shared lists and queues."""

    def __init__(self, graphs, tp: int):
        self.graphs, self.tp = graphs, tp
        stages = len(graphs) // tp
        self.barriers = [threading.Barrier(tp) for _ in range(stages)]
        self.boxes = [[None] * tp for _ in range(stages)]
        self.links = {(s, d): queue.Queue() for s in range(len(graphs)) for d in range(len(graphs))}

    def hooks(self, rank: int) -> Hooks:
        stage, tp_rank = divmod(rank, self.tp)
        barrier, box = self.barriers[stage], self.boxes[stage]

        def exchange(x):
            box[tp_rank] = x
            barrier.wait()
            pieces = list(box)
            barrier.wait()
            return pieces

        return Hooks(
            attention=lambda a: (lambda q, k, v: reference.dense_causal_attention(q, k, v, a)),
            gather_last=lambda x: x,
            all_reduce=lambda x, a: functools.reduce(torch.add, exchange(x)),
            all_gather=lambda x, a: torch.cat(exchange(x), dim=-1),
            send=lambda x, a: self.links[rank, a["dst"]].put(x),
            recv=lambda a: self.links[a["src"], rank].get(timeout=30))

    def logits(self, ids: list[int]) -> torch.Tensor:
        """[T, vocab] logits of every position, from the last stage's first rank."""
        results = {}

        def run(rank, graph):
            program = Program(json.loads(graph.to_json()), {n: graph.tensors[n] for n in graph.weights},
                              self.hooks(rank))
            results[rank] = program.run({"tokens": torch.tensor(ids), "positions": torch.arange(len(ids))})

        threads = [threading.Thread(target=run, args=(r, g)) for r, g in enumerate(self.graphs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        return results[len(self.graphs) - self.tp][0]


@pytest.mark.parametrize("fixture,tp,pp,quant", [
    ("tiny_llama_uneven_dir", 2, 1, "none"),
    ("tiny_llama_uneven_dir", 4, 1, "none"),    # 3 KV heads on 4 ranks: replicated
    ("tiny_llama_dir", 2, 2, "none"),
    ("tiny_llama_dir", 2, 1, "int8"),           # logical operands sliced, then packed per rank
    ("tiny_qwen2_dir", 2, 1, "none"),           # q, k, v biases split with their columns; o has none
    ("tiny_qwen2_dir", 1, 2, "none"),
    ("tiny_qwen2_tied_dir", 2, 1, "none"),      # one KV head on two ranks: replicated with its bias
    ("tiny_mistral_dir", 2, 1, "none"),         # sliding window on every layer
    ("tiny_mistral_uneven_dir", 1, 2, "none"),
    ("tiny_phi3_dir", 2, 1, "int8"),            # split fused weights, then sharded like Llama's
    ("tiny_phi3_longrope_dir", 1, 2, "none"),
    ("tiny_gemma3_dir", 2, 1, "none"),          # q/k head norms follow their heads onto the ranks
    ("tiny_gemma3_mqa_dir", 1, 2, "none"),
    ("tiny_gemma3_mqa_dir", 2, 1, "int8"),      # 3 query heads over 2 ranks, the one KV head replicated
])
def test_rank_programs_together_give_the_one_rank_logits(fixture, tp, pp, quant, request):
    model_dir = request.getfixturevalue(fixture)
    one = ThreadRanks(rank_graphs(model_dir, method=quant), 1).logits(IDS)
    many = ThreadRanks(rank_graphs(model_dir, tp, pp, method=quant), tp).logits(IDS)
    torch.testing.assert_close(many, one, atol=1e-4, rtol=0)


def test_row_split_of_int4_needs_shares_on_group_boundaries(tiny_llama_dir):
    graph, model = traced(tiny_llama_dir)
    quantized = quantize_int4(graph, PassContext(plan=plan(method="int4", group_size=32), model=model))
    # tp=3 gives o_proj's input columns [0, 16), [16, 32), [32, 64): not whole groups of 32.
    with pytest.raises(KilnError, match=r"o_proj: this rank's input columns \[\(16, 32\)\] do not fall on "
                                        r"group_size=32 boundaries"):
        shard_tensor_parallel(quantized, PassContext(plan=plan(3, method="int4"), rank=1))


# ---------------------------------------------------------------------------- engines and bad plans

@pytest.fixture(scope="module")
def sized_engines(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    sizes = {}
    for tp, pp in [(1, 1), (2, 1), (1, 2), (2, 2)]:
        manifest = build_engine(str(tiny_llama_dir), plan(tp, pp), root / f"tp{tp}pp{pp}", show_progress=False).manifest
        sizes[tp, pp] = (manifest, (root / f"tp{tp}pp{pp}" / "report.md").read_text())
    return sizes


def test_rank_files_add_up_to_one_model(sized_engines):
    whole = sum(r["bytes"] for r in sized_engines[1, 1][0]["ranks"])
    for (tp, pp), (manifest, _) in sized_engines.items():
        assert len(manifest["ranks"]) == tp * pp
        total = sum(r["bytes"] for r in manifest["ranks"])
        assert abs(total - whole) / whole < 0.05, (tp, pp, total, whole)


def test_manifest_and_report_show_each_ranks_share(sized_engines):
    manifest, report = sized_engines[2, 2]
    assert manifest["sharding"]["ranks"][3] == {"rank": 3, "tp_rank": 1, "pp_rank": 1, "layers": [2, 4],
                                                "q_heads": [2, 2], "kv_heads": [1, 1], "intermediate": [64, 64],
                                                "vocab": [160, 160]}
    assert "## Sharding (per rank)" in report
    assert "| 3 | 1 / 1 | [2, 4] | [2, 2] | [1, 1] | [64, 64] | [160, 160] |" in report


@pytest.mark.parametrize("tp,pp,limits,quant,message", [
    (5, 1, {}, {}, "shard_tensor_parallel: tp=5: more ranks than the model's 4 attention heads; use tp <= 4"),
    (1, 5, {}, {}, "split_pipeline_stages: pp=5: more stages than the model's 4 layers; use pp <= 4"),
    (2, 1, {"max_seq_len": 1 << 40}, {}, "plan does not fit cpu .* on rank 0"),
])
def test_bad_plans_fail_in_one_line_before_writing(tp, pp, limits, quant, message, tiny_llama_dir, tmp_path):
    chosen = plan(tp, pp, **quant).with_overrides("limits", **limits)
    with pytest.raises(KilnError, match=message) as error:
        build_engine(str(tiny_llama_dir), chosen, tmp_path / "engine", show_progress=False)
    assert "\n" not in str(error.value)
    assert not (tmp_path / "engine").exists()
