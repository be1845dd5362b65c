"""Multi-rank engines in real processes (gloo on CPU): parity with one rank, batches in flight with pp > 1,
torchrun, a lost rank, bad input."""

import dataclasses
import gc
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from builder.build import build_engine
from conftest import exact_plan
from runtime.core.engine import EngineOptions, LLMEngine
from runtime.launcher import open_llm_engine
from runtime.ranks import RankError
from runtime.core.sampling import SamplingParams
from runtime.backends.step import StepMetadata

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[1, 5, 9, 2, 77, 31], [3], list(range(10, 40))]
OPTIONS = EngineOptions(kv_cache_gib=0.01, rank_timeout=30)


@pytest.fixture(scope="module")
def engine(tmp_path_factory, request):
    """engine(fixture name, tp, pp) -> engine directory (float32, built once per module)."""
    root, built = tmp_path_factory.mktemp("multirank"), {}

    def get(fixture: str, tp: int = 1, pp: int = 1):
        if (fixture, tp, pp) not in built:
            plan = exact_plan(method="none").with_overrides(tp=tp, pp=pp)
            out = root / f"{fixture}-tp{tp}pp{pp}"
            build_engine(str(request.getfixturevalue(fixture)), plan, out, show_progress=False)
            built[fixture, tp, pp] = out
        return built[fixture, tp, pp]

    return get


def prefill(ids: list[int], block_size: int = 16) -> StepMetadata:
    """One sequence's whole prompt in blocks 0.., with the logits of every position."""
    t = len(ids)
    return StepMetadata(
        token_ids=torch.tensor(ids), positions=torch.arange(t), slot_mapping=torch.arange(t),
        block_tables=torch.arange(-(-t // block_size), dtype=torch.int32)[None],
        context_lens=torch.tensor([t], dtype=torch.int32), query_start_loc=torch.tensor([0, t], dtype=torch.int32),
        logits_indices=torch.arange(t))


def run(llm) -> tuple[torch.Tensor, list[list[int]]]:
    logits = llm.executor.execute(prefill(PROMPTS[2]))  # before generate: blocks 0.. are not in use yet
    return logits, [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]


def test_an_open_engine_is_frozen_out_of_the_collectors_scans(engine):
    # launcher.settled: what is alive once an engine is open lives as long as it, so full collections
    # skip it (they took 2-6% of a busy engine's CPU before).
    gc.unfreeze()
    with open_llm_engine(engine("tiny_llama_dir"), OPTIONS) as llm:
        assert gc.get_freeze_count() > 0
        assert len(llm.generate([PROMPTS[0]], GREEDY)[0].token_ids) == GREEDY.max_tokens
    gc.unfreeze()


@pytest.mark.parametrize("fixture,tp,pp", [
    ("tiny_llama_uneven_dir", 2, 1),  # 9 query / 3 KV heads: 6 + 3 and 2 + 1
    ("tiny_llama_dir", 3, 1),         # 4 query / 2 KV heads on 3 ranks: KV head 0 replicated
    ("tiny_llama_dir", 1, 2),
    ("tiny_llama_dir", 2, 2),
])
def test_ranks_give_the_tokens_and_logits_of_one_rank(fixture, tp, pp, engine):
    expected_logits, expected_tokens = run(LLMEngine.from_dir(engine(fixture), OPTIONS))
    with open_llm_engine(engine(fixture, tp, pp), OPTIONS) as llm:
        logits, tokens = run(llm)
    torch.testing.assert_close(logits, expected_logits, atol=1e-4, rtol=0)
    assert tokens == expected_tokens


def test_pp_keeps_two_batches_in_flight_and_gives_the_tokens_of_one_rank(engine):
    # More requests than max_batch_size, prompts longer than a step's tokens (chunked), a shared prefix.
    options = dataclasses.replace(OPTIONS, max_batch_size=8, max_num_tokens=32)
    prompts = [[(7 * i + 3 * j) % 300 + 3 for j in range(1 + 11 * i % 45)] for i in range(14)]
    prompts += [prompts[4][:20] + [5, 6], prompts[4][:20] + [9]]
    params = [SamplingParams(temperature=0.0, max_tokens=3 + 5 * i % 13, ignore_eos=True) for i in range(16)]
    one_rank = LLMEngine.from_dir(engine("tiny_llama_dir"), options)
    expected = [out.token_ids for out in one_rank.generate(prompts, params)]
    with open_llm_engine(engine("tiny_llama_dir", 1, 2), options) as llm:
        tokens = [out.token_ids for out in llm.generate(prompts, params)]
        stats = llm.stats()
    assert tokens == expected
    assert stats.peak_batches_in_flight == 2 and stats.batches_in_flight == 0 and stats.kv_usage == 0.0


def test_pp_abort_of_a_request_in_flight_frees_its_blocks_when_its_batch_returns(engine):
    with open_llm_engine(engine("tiny_llama_dir", 1, 2), OPTIONS) as llm:
        for prompt in PROMPTS + [[7, 8, 9, 10]]:
            llm.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        llm.step()  # submits two batches of two requests, returns the first
        (batch, _), = llm.in_flight
        seq = batch.seqs[0]
        blocks = list(seq.block_table)
        assert llm.abort(seq.request_id)
        assert not seq.is_finished and seq.block_table == blocks  # its batch still writes their K/V
        outputs = llm.step()  # submits the next batch, returns the one holding seq
        assert seq.request_id not in [out.request_id for out in outputs]
        assert seq.finish_reason == "abort" and seq.block_table == []
        assert all(llm.scheduler.block_manager.blocks[b].ref_count == 0 for b in blocks)
        while llm.has_unfinished():
            llm.step()
        assert llm.stats().kv_usage == 0.0


def test_pp_rank_lost_with_batches_in_flight_is_named_and_reaped(engine):
    options = dataclasses.replace(OPTIONS, rank_timeout=5)
    with pytest.raises(RankError, match=r"^rank 1 died \(killed by SIGKILL\)"):
        with open_llm_engine(engine("tiny_llama_dir", 1, 2), options) as llm:
            rank1 = llm.executor.rank.children[1]
            for prompt in PROMPTS + [[7, 8, 9, 10]]:
                llm.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
            llm.step()
            assert llm.stats().batches_in_flight == 1
            rank1.kill()
            start = time.monotonic()
            while True:
                llm.step()
    assert time.monotonic() - start < options.rank_timeout + 3
    assert rank1.poll() is not None


def engine_run(*args, env=None, **popen):
    return subprocess.Popen([sys.executable, "-m", "runtime.cli", "generate", *map(str, args)], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, **popen)


def test_torchrun_on_one_host_gives_the_same_text(engine):
    expected = LLMEngine.from_dir(engine("tiny_llama_dir"), OPTIONS).generate(
        ["Hello world"], SamplingParams(temperature=0.0, max_tokens=8))[0].text
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", "-m", "runtime.cli",
         "generate", str(engine("tiny_llama_dir", 2)), "-p", "Hello world", "--max-tokens", "8",
         "--kv-cache-gib", "0.01"], capture_output=True, text=True, timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected + "\n"


def children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(entry))
    return found


def is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("tp,pp,sig", [(2, 1, signal.SIGKILL), (2, 1, signal.SIGSTOP), (1, 2, signal.SIGKILL)],
                         ids=["killed", "hung", "killed-pp2"])
def test_a_lost_rank_stops_every_rank_within_the_timeout(tp, pp, sig, engine):
    timeout = 5
    proc = engine_run(engine("tiny_llama_dir", tp, pp), "-p", "Hello world", "--max-tokens", "1500",
                      "--kv-cache-gib", "0.01", "--rank-timeout", timeout)
    assert proc.stdout.read(8)  # generating: streamed text arrives
    ranks = children_of(proc.pid)
    assert len(ranks) == 1
    os.kill(ranks[0], sig)
    start = time.monotonic()
    _, stderr = proc.communicate(timeout=timeout + 30)
    waited = time.monotonic() - start
    assert proc.returncode == 1
    assert stderr.strip().splitlines() == [stderr.strip()] and stderr.startswith("engine-run: error: rank 1 ")
    assert ("killed by SIGKILL" if sig == signal.SIGKILL else "stopped responding") in stderr
    assert waited < timeout + 3
    assert not is_running(ranks[0])


def test_bad_input_fails_in_one_line_before_any_rank_starts(engine, tmp_path):
    import shutil

    broken = tmp_path / "engine"
    shutil.copytree(engine("tiny_llama_dir", 2), broken)
    (broken / "rank1.engine").unlink()
    proc = engine_run(broken, "-p", "hi")
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1 and stderr == f"engine-run: error: {broken}: rank 1 file rank1.engine is missing; " \
                                              f"rebuild the engine\n"
    # Started (as torchrun would) with a world size other than the engine's rank count.
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    proc = engine_run(engine("tiny_llama_dir", 2), "-p", "hi", env=env)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1 and stderr.count("\n") == 1
    assert "the engine has 2 rank(s) but was started with world size 3; start it with 2 rank(s)" in stderr
