"""`engine-build plan` end to end: its table, JSON, picture and plan file; its one-line errors; and the
one source of truth it shares with the build (the same memory plan, the same refusal)."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys

import pytest

from builder.build import build_engine
from builder.errors import KilnError
from builder.planning.plan import load_plan
from builder.planning.planner import Workload, plan_candidates
from builder.planning.shapes import load_shape
from conftest import exact_plan


def plan_cli(*args):
    return subprocess.run([sys.executable, "-m", "builder.cli", "plan", *map(str, args)], capture_output=True,
                          text=True, timeout=120)


def assert_one_line_error(proc, pattern):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("engine-build: error: ") and re.search(pattern, lines[0]), lines[0]


def test_seventy_b_on_h100s_table_json_picture_and_plan(tmp_path):
    png, toml = tmp_path / "plan.png", tmp_path / "plan.toml"
    proc = plan_cli("--model", "llama-3.1-70b", "--device", "nvidia-h100-80gb", "--plot", png, "--out", toml)
    assert proc.returncode == 0, proc.stderr
    assert "KV cache 327,680 B a token in f16" in proc.stdout
    assert re.search(r"nvidia-h100-80gb: fewest devices that fit: .*none tp=2", proc.stdout)
    assert "weights 131.42 GiB + workspace" in proc.stdout  # the tp=1 16-bit row says why it does not fit
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plan = load_plan(toml)
    assert plan.device == "nvidia-h100-80gb" and plan.target == "cuda"
    report = json.loads(plan_cli("--model", "llama-3.1-70b", "--device", "nvidia-h100-80gb", "--json").stdout)
    rows = {(c["tp"], c["weights"]): c for c in report["candidates"] if c["pp"] == 1}
    assert rows[(1, "none")]["problem"] and rows[(2, "none")]["problem"] is None
    assert rows[(2, "none")]["kv_tokens"] > 0 and report["recommended"]["device"] == "nvidia-h100-80gb"


def test_sizing_a_chat_product_in_one_command():
    proc = plan_cli("--model", "llama-3.1-70b", "--device", "nvidia-h100-80gb", "--device", "nvidia-a100-80gb",
                    "--users", 10000, "--input", 500, "--output", 200, "--latency", 2, "--json")
    assert proc.returncode == 0, proc.stderr
    best = json.loads(proc.stdout)["recommended"]
    z = best["sizing"]
    assert z["feasible"] and z["latency_s"] <= 2 and z["devices"] == z["replicas"] * best["tp"] * best["pp"]
    assert z["usd_per_hour"] > 0 and z["usd_per_million_tokens"] > 0


@pytest.mark.parametrize("args,pattern", [
    (["--device", "nvidia-z9000"], r"device 'nvidia-z9000' is not in the catalog \(known: cpu, "),
    (["--tp", "5"], r"--tp 5: divides none of the model's sizes .* use one of 1, 2, 4, 8"),
    (["--device", "nvidia-t4", "--tp", "1", "--pp", "1", "--weights", "none"],
     r"no candidate fits: allow more devices \(--tp, --pp\), a smaller KV dtype .*quantized weights"),
    (["--device", "nvidia-h100-80gb", "--users", "100", "--latency", "0.01"],
     r"no candidate meets the objectives for 100 users"),
    (["--price", "nvidia-h100-80gb"], r"--price 'nvidia-h100-80gb': expected DEVICE=USD"),
    (["--input", "0"], r"workload: input must be >= 1"),
])
def test_bad_input_is_one_line_and_a_failing_exit(args, pattern):
    assert_one_line_error(plan_cli("--model", "llama-3.1-70b", *args), pattern)


def test_a_bad_config_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 100, "num_attention_heads": 3}))
    assert_one_line_error(plan_cli("--model", tmp_path), r"config lacks vocab_size")
    (tmp_path / "config.json").write_text(json.dumps({
        "vocab_size": 100, "hidden_size": 100, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 3, "num_key_value_heads": 1}))
    assert_one_line_error(plan_cli("--model", tmp_path / "config.json"), r"num_heads 3 does not divide hidden_size 100")


def test_the_planner_prices_the_default_engine_as_its_build_did(smollm2_default_engine):
    """One source of truth: the planner's memory plan of the default plan is the built engine's."""
    manifest = json.loads((smollm2_default_engine / "manifest.json").read_text())
    built = manifest["memory"]["ranks"][0]
    report = plan_candidates(load_shape("smollm2-135m"), plan=load_plan(), workload=Workload(1024, 1024))
    c = report.candidates[0]
    assert round(c.weight_gib * (1 << 30)) == built["weight_bytes"]
    assert round(c.workspace_gib * (1 << 30)) == built["workspace_bytes"]
    assert c.kv_tokens == built["kv_blocks"] * 16


def test_the_planner_prices_windowed_layers_as_the_build_does(tiny_mistral_dir, tiny_gemma3_dir, tmp_path):
    """Sliding-window layers in a pool of their own (every layer windowed, or beside full ones): the planner's
    pools are the built engine's, and they hold more sequences than the same layers priced as full ones."""
    plan = exact_plan()
    for model_dir in (tiny_mistral_dir, tiny_gemma3_dir):
        built = build_engine(str(model_dir), plan, tmp_path / model_dir.name, show_progress=False).manifest
        rank = built["memory"]["ranks"][0]
        shape, workload = load_shape(str(model_dir)), Workload(1024, 1024)
        c = plan_candidates(shape, plan=plan, workload=workload).candidates[0]
        assert round(c.weight_gib * (1 << 30)) == rank["weight_bytes"]
        assert c.kv_pools == ((rank["kv_blocks"],) if not rank.get("kv_window_blocks")
                              else (rank["kv_blocks"], rank["kv_window_blocks"]))
        [as_full] = plan_candidates(dataclasses.replace(shape, layer_windows=()), plan=plan,
                                    workload=workload).candidates
        if len(c.kv_pools) == 1:  # every layer windowed: more sequences in the same memory
            assert c.sequences > as_full.sequences
        else:  # the windowed pool holds the batch; what the windowed layers save goes to the full layers
            assert c.sequences == plan.limits.max_batch_size and c.kv_tokens > as_full.kv_tokens


def test_the_build_refuses_a_plan_the_planner_refuses_with_the_same_words(tiny_llama_dir, tmp_path):
    plan = exact_plan(method="none").with_overrides("limits", max_seq_len=1 << 40)
    report = plan_candidates(load_shape(str(tiny_llama_dir)), plan=plan)
    problem = report.candidates[0].problem
    assert problem and problem.startswith("plan does not fit cpu")
    with pytest.raises(KilnError) as error:
        build_engine(str(tiny_llama_dir), plan, tmp_path / "engine", show_progress=False)
    assert str(error.value) == problem
    assert not (tmp_path / "engine").exists()
