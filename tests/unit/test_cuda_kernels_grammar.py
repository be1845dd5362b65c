"""The cuda backend's grammar mask and top-logprobs kernels (runtime/backends/cuda/kernels/sampling.py) in Triton's
interpreter, against the host's mask (_ops.mask_rows_bits) and log_softmax top-k, and the DeviceSampler that runs
them against the cpu Sampler on the same steps: constrained and free rows, log-probs with alternatives, an engine
whose kernels predate them."""

import numpy as np
import pytest
import torch

from runtime._native import _ops
from runtime.backends.cuda.kernels import sampling
from runtime.backends.cuda.launch import InterpreterLauncher, RecordingLauncher
from runtime.backends.cuda.sampler import DeviceSampler, launch_sampler_kernels
from runtime.core.constraints import json_schema_grammar, regex_grammar
from runtime.core.sampler import Sampler, token_logprobs
from runtime.core.sampling import SamplingParams
from runtime.core.sequence import Sequence

TILE = 128


@pytest.mark.parametrize("V", [70, 96, 300])
def test_the_mask_kernel_refuses_what_the_host_mask_refuses(V):
    """Masks of 3 words (96 tokens) over rows narrower, as wide and wider; all set, all clear, mixed and bit 31 set
    (a negative word); rows not named untouched."""
    rng = np.random.default_rng(V)
    bits = rng.integers(-2**31, 2**31, size=(3, 3), dtype=np.int64).astype(np.int32)
    bits[1, 0], bits[1, 1], bits[2, 2] = -1, 0, np.int32(-2**31)
    logits = torch.from_numpy(rng.standard_normal((5, V)).astype(np.float32))
    rows = np.array([4, 0, 2], dtype=np.int64)
    expected = logits.clone()
    _ops.mask_rows_bits(expected.numpy(), rows, bits, V, 3, 1)
    sampling.mask_bits(InterpreterLauncher(), logits, torch.from_numpy(rows), torch.from_numpy(bits), tile=32)
    assert torch.equal(logits, expected)
    assert bool(torch.isinf(logits[[4, 0, 2]]).any()) and not bool(torch.isinf(logits[[1, 3]]).any())


def test_top_logprobs_equal_log_softmax_top_k_with_ties_to_the_lower_id():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 700, generator=gen) * 3
    logits[1, [5, 300, 650]] = 12.0                # a three-way tie for the top, in different tiles
    logits[2] = float("-inf")
    logits[2, [7, 100]] = 1.0                      # two finite tokens, then -inf ones by id
    logits[3, 256] = logits[3, 384] = 11.0         # the same lane in two tiles
    tokens = torch.tensor([3, 650, 7, 384, 699], dtype=torch.int32)
    chosen, values, ids = sampling.top_logprobs(InterpreterLauncher(), logits, tokens, 6, tile=TILE)
    expected = token_logprobs(logits, tokens.long(), 6)
    torch.testing.assert_close(chosen, torch.tensor([float(e) for e in expected]), rtol=0, atol=1e-5)
    assert ids.tolist() == [[i for i, _ in e.top] for e in expected]
    torch.testing.assert_close(values, torch.tensor([[v for _, v in e.top] for e in expected]), rtol=0, atol=1e-5)
    assert ids[1, :3].tolist() == [5, 300, 650] and ids[2].tolist()[:4] == [7, 100, 0, 1]
    none, _, empty = sampling.top_logprobs(InterpreterLauncher(), logits, tokens, 0, tile=TILE)
    assert torch.equal(none, chosen) and empty.shape == (5, 0)
    with pytest.raises(ValueError, match="between 0 and 20"):
        sampling.top_logprobs(InterpreterLauncher(), logits, tokens, 21)


def constrained_step(grammars, seed: int) -> tuple[torch.Tensor, list[Sequence]]:
    """Six greedy sequences over the fixture's 300 tokens: two under a grammar, three asking for log-probs."""
    grammar = {0: json_schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}}}),
               3: regex_grammar("[0-9]{3}-[0-9]{2}")}
    seqs = []
    for i in range(6):
        params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=i % 2 == 1 or i == 0,
                                top_logprobs=(0, 2, 0, 5, 0, 1)[i], grammar=grammar.get(i))
        seq = Sequence(f"s{i}", [1, 2, 3], params)
        seq.constraint = grammars.constraint(grammar[i]) if i in grammar else None
        seqs.append(seq)
    return torch.randn(6, 300, generator=torch.Generator().manual_seed(seed)) * 4, seqs


@pytest.mark.parametrize("allowed", ["every variant", "greedy alone"])
def test_the_device_sampler_gives_the_host_samplers_tokens_and_log_probs(grammars, allowed):
    """Three steps: each token equals the cpu Sampler's, constrained rows follow their grammars (taken on the
    device: the grammars advance), log-probs within 1e-5 with the same alternatives. An engine that holds only the
    greedy kernel (built before the mask and top-logprobs kernels) samples those steps on the host instead."""
    launcher = InterpreterLauncher()
    if allowed == "greedy alone":
        recorder = RecordingLauncher()
        sampling.greedy(recorder, torch.empty(2, 300, device="meta"))
        launcher.allowed = set(recorder.seen)
    _, host_seqs = constrained_step(grammars, 0)
    _, device_seqs = constrained_step(grammars, 0)
    for step in range(3):
        logits, _ = constrained_step(grammars, step)
        expected_tokens, expected_lps = Sampler().sample(logits.clone(), host_seqs)
        tokens, lps = DeviceSampler(launcher).sample(logits.clone(), device_seqs)
        assert tokens == expected_tokens
        for lp, want in zip(lps, expected_lps):
            assert (lp is None) == (want is None)
            if lp is not None:
                assert abs(lp - want) < 1e-5 and [i for i, _ in lp.top] == [i for i, _ in want.top]
                assert all(a == b or abs(a - b) < 1e-5 for (_, a), (_, b) in zip(lp.top, want.top))  # -inf too
        for host, device in zip(host_seqs, device_seqs):
            host.output_token_ids.append(expected_tokens[host_seqs.index(host)])
            device.output_token_ids.append(tokens[device_seqs.index(device)])
    assert grammars._tokenizer.decode(device_seqs[0].output_token_ids).startswith("{")
    assert set(grammars._tokenizer.decode(device_seqs[3].output_token_ids)) <= set("0123456789-")
    launched = {key.split(".")[0] for key in launcher.launched}
    # every step has a constrained row: without the mask kernel nothing runs on the device
    assert launched == (set() if allowed == "greedy alone"
                        else {"_mask_bits_kernel", "_greedy_kernel", "_top_logprobs_kernel"})


def test_a_build_compiles_the_samplers_three_kernels_once_whatever_the_batch_and_vocabulary():
    keys = []
    for R, V in ((2, 300), (5, 151936)):
        recorder = RecordingLauncher()
        launch_sampler_kernels(recorder, torch.empty(R, V, device="meta"))
        keys.append(set(recorder.seen))
    assert keys[0] == keys[1] and {k.split(".")[0] for k in keys[0]} == {
        "_mask_bits_kernel", "_greedy_kernel", "_top_logprobs_kernel"}
