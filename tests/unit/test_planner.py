"""`engine-build plan`'s arithmetic against hand computations: parameters, weight and KV bytes per
rank, KV capacity, and the sizing of a workload (replicas, devices, cost)."""

import math

import pytest

from builder.planning.plan import load_devices
from builder.planning.planner import Link, Workload, allgather, allreduce, node_of, plan_candidates, transfer
from builder.planning.report import plan_toml
from builder.planning.shapes import PlanningError, load_shape
from runtime.format.engine_format import GIB

# Llama 3.1 70B by hand: per layer q and o (8192 x 8192 each), k and v (1024 x 8192 each), gate, up, down.
LAYER_70B = 2 * 8192 * 8192 + 2 * 1024 * 8192 + 3 * 8192 * 28672
PARAMS_70B = 80 * (LAYER_70B + 2 * 8192) + 2 * 128256 * 8192 + 8192  # + norms, embedding, lm_head, final norm


def candidate(report, tp, pp=1, weights="none"):
    return next(c for c in report.candidates if (c.tp, c.pp, c.weights) == (tp, pp, weights))


def test_llama_70b_shape_and_kv_bytes_are_the_published_ones():
    shape = load_shape("llama-3.1-70b")
    assert shape.parameters == PARAMS_70B == 70_553_706_496
    assert shape.kv_bytes_per_token("f16") == 2 * 80 * 8 * 128 * 2 == 327_680
    assert shape.kv_bytes_per_token("fp8") == 163_840


def test_fp16_70b_needs_two_h100s_and_each_rank_holds_what_a_hand_computation_says():
    report = plan_candidates(load_shape("llama-3.1-70b"), devices=["nvidia-h100-80gb"], weights=["none"],
                             pps=[1])
    one, two = candidate(report, 1), candidate(report, 2)
    assert one.weight_gib * GIB == 2 * PARAMS_70B  # 141 GB of 16-bit weights
    assert not one.fits and "exceed" in one.problem
    assert two.fits and min(c.tp for c in report.candidates if c.fits) == 2
    # tp=2: half of every layer's heads and MLP columns, half the vocabulary of each table, every norm
    rank = 80 * LAYER_70B // 2 + 2 * (128256 // 2) * 8192 + (2 * 80 + 1) * 8192
    assert two.weight_gib * GIB == 2 * rank
    workspace = 4 * (6 * 2048 * max(8192, (32 + 2 * 4) * 128, 2 * 14336) + 256 * 128256)
    assert two.workspace_gib * GIB == workspace
    per_token = 2 * 80 * 4 * 128 * 2  # each rank caches its 4 KV heads
    blocks = int((80 * GIB - 2 * rank - workspace) * 0.9 // (per_token * 16))
    assert two.kv_tokens == 16 * blocks
    assert two.sequences == blocks // math.ceil((512 + 256) / 16)


# Mixtral 8x7B by hand: per layer attention (q, o 4096 x 4096; k, v 1024 x 4096), the router (8 x 4096) and 8
# experts of gate, up and down (4096 x 14336 each); a token runs 2 of them.
ATTENTION_MIXTRAL = 2 * 4096 * 4096 + 2 * 1024 * 4096
EXPERT_MIXTRAL = 3 * 4096 * 14336
LAYER_MIXTRAL = ATTENTION_MIXTRAL + 8 * 4096 + 8 * EXPERT_MIXTRAL
PARAMS_MIXTRAL = 32 * (LAYER_MIXTRAL + 2 * 4096) + 2 * 32000 * 4096 + 4096


def test_mixtral_8x7b_is_priced_by_hand_with_its_experts_split_between_tp_ranks():
    shape = load_shape("mixtral-8x7b")
    assert shape.parameters == PARAMS_MIXTRAL == 46_702_792_704  # the published 46.7 B
    active = 32 * (ATTENTION_MIXTRAL + 8 * 4096 + 2 * EXPERT_MIXTRAL + 2 * 4096) + 32000 * 4096 + 4096
    assert shape.active_parameters == active  # 12.7 B a token (the published 12.9 B counts the embedding too)
    report = plan_candidates(shape, devices=["nvidia-h100-80gb"], weights=["none"], kv_dtypes=["f16"], pps=[1])
    one, two = candidate(report, 1), candidate(report, 2)
    assert not one.fits and two.fits
    # tp=2: half the heads, 4 whole experts and the whole router a layer, half the vocabulary, every norm
    rank = 32 * (ATTENTION_MIXTRAL // 2 + 8 * 4096 + 4 * EXPERT_MIXTRAL) + 2 * (32000 // 2) * 4096 + (2 * 32 + 1) * 4096
    assert two.weight_gib * GIB == 2 * rank
    # batch-1 decode reads the chosen experts only: in expectation 1 - (1 - 2/8) of each rank's 4 experts
    device = load_devices()["nvidia-h100-80gb"]
    experts = 32 * 4 * EXPERT_MIXTRAL * 2
    linear = 2 * (32 * (ATTENTION_MIXTRAL // 2 + 8 * 4096 + 4 * EXPERT_MIXTRAL))
    read = linear + 2 * (32000 // 2) * 4096 - experts * (1 - 2 / 8)
    kv = (512 + 128) * 32 * 2 * 4 * 128 * 2  # one sequence at the workload's mean context, this rank's 4 KV heads
    bandwidth = device.bandwidth_gbs * 1e9 * device.bandwidth_efficiency
    # an all-reduce after each attention and mixture and after the embedding: 2 (tp - 1) / tp = 1 of a token's
    # hidden state in bf16 over the link
    all_reduces = (2 * 32 + 1) * (device.link_latency_us * 1e-6 + 4096 * 2 / (device.link_gbs * 1e9))
    # and the logits' gather: each rank's half of the vocabulary's row in bf16 to the other
    gather = device.link_latency_us * 1e-6 + 32000 * 2 / 2 / (device.link_gbs * 1e9)
    assert two.decode[1] == pytest.approx((read + kv) / bandwidth + all_reduces + gather, rel=1e-9)
    assert two.decode[64] < 64 * two.decode[1]


def test_a_large_mixture_reads_a_tenth_of_its_weights_a_token():
    shape = load_shape("qwen3-235b-a22b")
    assert round(shape.parameters / 1e9) == 235 and round(shape.active_parameters / 1e9) == 22


def test_a_chat_product_for_ten_thousand_users_is_sized_and_priced_consistently():
    workload = Workload(input_tokens=500, output_tokens=200, users=10_000, latency_s=2.0)
    report = plan_candidates(load_shape("llama-3.1-70b"), devices=["nvidia-h100-80gb"], workload=workload)
    best = report.recommended
    z = best.sizing
    assert z["feasible"] and z["latency_s"] <= 2.0
    assert z["latency_s"] == pytest.approx(z["ttft_s"] + 200 * z["itl_s"])
    assert z["replicas"] == math.ceil(10_000 / (best.pp * z["batch"]))
    assert z["devices"] == z["replicas"] * best.tp * best.pp
    price = load_devices()["nvidia-h100-80gb"].price_per_hour
    assert z["usd_per_hour"] == pytest.approx(z["devices"] * price)
    tokens_per_s = z["replicas"] * best.pp * z["batch"] / z["itl_s"]
    assert z["usd_per_million_tokens"] == pytest.approx(z["usd_per_hour"] / (tokens_per_s * 3600) * 1e6)
    larger = [b for b in best.serving if b > z["batch"]]  # the batch is the largest within the objective
    if larger:
        b = larger[0]
        itl = best.serving[b]
        assert best.pp * b > best.sequences or best.prefill_s + itl + 200 * itl > 2.0
    cheapest = min(c.sizing["usd_per_hour"] for c in report.candidates if c.sizing and c.sizing["feasible"])
    assert z["usd_per_hour"] == cheapest


def test_pipeline_stages_appear_only_where_tensor_parallelism_alone_does_not_fit():
    report = plan_candidates(load_shape("llama-3.1-405b"), devices=["nvidia-h100-80gb"], weights=["none"])
    assert not any(c.fits for c in report.candidates if c.pp == 1)
    deep = [c for c in report.candidates if c.fits]
    assert deep and min(c.pp for c in deep) == 2 and all(c.pp == 2 for c in report.candidates if c.pp > 1)


def test_tensor_parallelism_speeds_decode_and_the_all_reduce_costs_something():
    report = plan_candidates(load_shape("llama-3.1-8b"), devices=["nvidia-h100-80gb"], weights=["fp8"], pps=[1])
    tp1, tp8 = candidate(report, 1, weights="fp8"), candidate(report, 8, weights="fp8")
    assert tp8.tokens_per_s(1) > tp1.tokens_per_s(1)
    assert tp8.tokens_per_s(1) < 8 * tp1.tokens_per_s(1)  # bandwidth scales by 8, the all-reduces do not


def test_the_recommended_plan_is_a_valid_plan_file(tmp_path):
    from builder.planning.plan import load_plan

    shape = load_shape("qwen2.5-7b")
    report = plan_candidates(shape, devices=["nvidia-l40s"], workload=Workload(users=64))
    path = tmp_path / "plan.toml"
    path.write_text(plan_toml(report.recommended, shape, report.workload))
    plan = load_plan(path)
    best = report.recommended
    assert (plan.device, plan.tp, plan.pp, plan.quant.method) == ("nvidia-l40s", best.tp, best.pp, best.weights)


@pytest.mark.parametrize("kwargs,message", [
    ({"devices": ["nvidia-z9000"]}, "device 'nvidia-z9000' is not in the catalog"),
    ({"tps": [5]}, "--tp 5: divides none of the model's sizes"),
    ({"pps": [81]}, "--pp 81: must be between 1 and the model's 80 layers"),
    ({"workload": Workload(input_tokens=0)}, "workload: input must be >= 1"),
    ({"workload": Workload(latency_s=-1.0)}, "workload: latency must be > 0 seconds"),
    ({"prices": {"h100": 2.0}}, "--price h100: not a device of the catalog"),
])
def test_bad_planner_input_is_named(kwargs, message):
    with pytest.raises(PlanningError, match=message):
        plan_candidates(load_shape("llama-3.1-70b"), **kwargs)


@pytest.mark.parametrize("config,message", [
    ({"hidden_size": 4096, "num_layers": 32}, "config lacks vocab_size, intermediate_size, num_heads, num_kv_heads"),
    ({"vocab_size": 100, "hidden_size": 100, "intermediate_size": 256, "num_hidden_layers": 2,
      "num_attention_heads": 3, "num_key_value_heads": 1}, "num_heads 3 does not divide hidden_size 100"),
    ({"vocab_size": 100, "hidden_size": 96, "intermediate_size": 256, "num_hidden_layers": 2,
      "num_attention_heads": 6, "num_key_value_heads": 4}, "num_kv_heads 4 does not divide num_heads 6"),
    ({"vocab_size": 100, "hidden_size": 96, "intermediate_size": -1, "num_hidden_layers": 2,
      "num_attention_heads": 6, "num_key_value_heads": 2}, "intermediate_size must be a positive integer"),
])
def test_a_bad_config_is_named_in_one_line(config, message, tmp_path):
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(PlanningError, match=message) as error:
        load_shape(str(path))
    assert "\n" not in str(error.value)


def test_hugging_face_names_and_nested_text_configs_are_read(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForConditionalGeneration"],
                                                      "model_type": "gemma3",
                                                      "text_config": {**load_shape_fields(), "head_dim": 128,
                                                                      "model_type": "gemma3_text"}}))
    shape = load_shape(str(tmp_path))
    assert (shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim) == (62, 32, 16, 128)
    assert shape.parameters == load_shape("gemma-3-27b").parameters


def load_shape_fields():
    return {"vocab_size": 262208, "hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 62,
            "num_attention_heads": 32, "num_key_value_heads": 16, "tie_word_embeddings": True}


def test_ranks_over_hosts_pay_the_node_link_where_they_cross_it():
    """tp=8 pp=2 on H100s over two hosts: each tp group stays on its host, the one hand-over crosses, so each decode
    step costs exactly one node-link transfer more than one link transfer; tp=2 over two hosts sends every
    all-reduce and the logits' gather across."""
    shape = load_shape("llama-3.1-70b")
    device = load_devices()["nvidia-h100-80gb"]
    within = Link(device.link_gbs, device.link_latency_us)
    between = Link(device.node_link_gbs, device.node_link_latency_us)
    one, two = (candidate(plan_candidates(shape, devices=["nvidia-h100-80gb"], weights=["none"], tps=[8], pps=[2],
                                          nodes=n), 8, 2) for n in (1, 2))
    assert [node_of(two, r) for r in range(16)] == [0] * 8 + [1] * 8 and two.nodes == 2
    handed = 8 * shape.hidden_size * 2  # 8 sequences' hidden states, 2 bytes each
    assert two.decode[8] - one.decode[8] == pytest.approx(transfer(between, handed) - transfer(within, handed))
    cpu = load_devices()["cpu"]
    small = load_shape("smollm2-135m")
    apart = candidate(plan_candidates(small, devices=["cpu"], weights=["source"], tps=[2], pps=[1], nodes=2), 2,
                      weights="source")
    together = candidate(plan_candidates(small, devices=["cpu"], weights=["source"], tps=[2], pps=[1]), 2,
                         weights="source")
    links = {Link(cpu.link_gbs, cpu.link_latency_us): "loopback",
             Link(cpu.node_link_gbs, cpu.node_link_latency_us): "node"}
    exchanges = {name: (2 * small.num_layers + 1) * allreduce(link, 2, small.hidden_size * 4)
                 + allgather(link, 2, small.vocab_size * 4) for link, name in links.items()}
    # the rest of the step: on two hosts each rank has a host's cores and memory to itself
    assert apart.decode[1] - exchanges["node"] < together.decode[1] - exchanges["loopback"]
    assert apart.decode[1] - together.decode[1] < exchanges["node"] - exchanges["loopback"]


def test_hosts_the_ranks_do_not_divide_among_or_a_device_without_a_node_link_are_refused():
    shape = load_shape("smollm2-135m")
    spread = plan_candidates(shape, devices=["cpu"], weights=["source"], nodes=2)
    assert spread.candidates and all(c.devices % 2 == 0 for c in spread.candidates)
    with pytest.raises(PlanningError, match="'nvidia-l4' has no node link"):
        plan_candidates(shape, devices=["nvidia-l4"], nodes=2)
    with pytest.raises(PlanningError, match="must be >= 1"):
        plan_candidates(shape, devices=["cpu"], nodes=0)
