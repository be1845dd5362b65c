"""lm-evaluation-harness against Kiln's server, as an evaluator runs it: its `local-completions` model scores a
multiple-choice task (a local file, tests/data/lm_eval) through /v1/completions with echo and logprobs, and gives
the per-choice log-likelihoods (within 1e-3) and accuracy of lm-eval's own `hf` model on the same SmolLM2 weights
in float32, against the exact engine."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_server import ServerProcess

DATA = Path(__file__).resolve().parents[1] / "data" / "lm_eval" / "kiln_mc.jsonl"
TASK = """task: kiln_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def evaluate(model: str, model_args: str, tasks_dir: Path) -> dict:
    """lm-eval's results for kiln_mc with its samples: {"acc": ..., "lls": [[choice log-likelihoods] per doc]}."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(model=model, model_args=model_args, tasks=["kiln_mc"], log_samples=True,
                              task_manager=TaskManager(include_path=str(tasks_dir)), random_seed=0)
    samples = sorted(results["samples"]["kiln_mc"], key=lambda s: s["doc_id"])
    return {"acc": results["results"]["kiln_mc"]["acc,none"],
            "lls": [[ll for ll, _ in sample["filtered_resps"]] for sample in samples]}


def test_local_completions_scores_as_the_hf_model(smollm2_exact_engine, smollm2_gguf, tmp_path):
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is in the test extra")
    (tmp_path / "kiln_mc.yaml").write_text(TASK.format(data=DATA))
    server = ServerProcess(smollm2_exact_engine, tmp_path / "server.log")
    try:
        ours = evaluate("local-completions",
                        f"model=tiny,base_url={server.url}/v1/completions,tokenizer={smollm2_exact_engine},"
                        "tokenized_requests=True,num_concurrent=1,max_retries=1", tmp_path)
    finally:
        assert server.stop() == 0, server.log()
    theirs = evaluate("hf", f"pretrained={smollm2_gguf.parent},gguf_file={smollm2_gguf.name},"
                            f"tokenizer={smollm2_exact_engine},dtype=float32,device=cpu", tmp_path)
    print(f"\nkiln_mc accuracy: Kiln {ours['acc']:.3f}, hf {theirs['acc']:.3f}")
    assert len(ours["lls"]) == len(theirs["lls"]) == sum(1 for _ in DATA.open())
    for mine, reference in zip(ours["lls"], theirs["lls"]):
        assert mine == pytest.approx(reference, abs=1e-3)
    assert ours["acc"] == theirs["acc"]
