"""Sampler and SamplingParams: greedy, filters, per-request seeds, log-probs, validation."""

import math

import numpy as np

import pytest
import torch

from runtime.core.sampler import Sampler
from runtime.core.sampling import SamplingParams
from runtime.core.sequence import Sequence

VOCAB = 64


def seqs_with(*params_list):
    return [Sequence(f"r{i}", [1], params) for i, params in enumerate(params_list)]


def random_logits(rows, seed=0):
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_with_ties_to_the_lowest_id():
    logits = random_logits(4)
    logits[3] = 0.0
    logits[3, [5, 9, 40]] = 2.0
    tokens, logprobs = Sampler().sample(logits, seqs_with(*[SamplingParams(temperature=0.0)] * 4))
    assert tokens == logits[:3].argmax(dim=-1).tolist() + [5]
    assert logprobs == [None] * 4
    # the same tokens on the general path (log-probs asked for one row) as on the greedy shortcut
    mixed = [SamplingParams(temperature=0.0)] * 3 + [SamplingParams(temperature=0.0, logprobs=True)]
    tokens_mixed, logprobs_mixed = Sampler().sample(logits, seqs_with(*mixed))
    assert tokens_mixed == tokens and logprobs_mixed[:3] == [None] * 3 and logprobs_mixed[3] < 0


@pytest.mark.parametrize("filters", [dict(top_k=1), dict(top_p=1e-6), dict(top_k=1, top_p=0.5)])
def test_top_k_one_and_tiny_top_p_equal_greedy(filters):
    logits = random_logits(16, seed=1)
    logits[0, [3, 7]] = 100.0  # a tie at the top goes to the lower id, as in greedy
    params = [SamplingParams(temperature=1.5, seed=i, **filters) for i in range(16)]
    tokens, _ = Sampler().sample(logits, seqs_with(*params))
    assert tokens == Sampler().sample(logits, seqs_with(*[SamplingParams(temperature=0.0)] * 16))[0]
    assert tokens[0] == 3


def draw(params, logits_row, n):
    """n tokens of one sequence, sampled one step at a time (each output position has its own noise)."""
    seq = Sequence("s", [1], params)
    for _ in range(n):
        seq.append_token(Sampler().sample(logits_row.unsqueeze(0), [seq])[0][0])
    return seq.output_token_ids


def test_seeded_sampling_is_reproducible_whatever_else_is_in_the_batch():
    logits = random_logits(1, seed=2)[0]
    params = SamplingParams(temperature=1.5, top_k=20, top_p=0.9, seed=1234)
    alone = draw(params, logits, 20)
    assert alone == draw(params, logits, 20)
    assert len(set(alone)) > 1  # really sampling

    # The same request in a batch: at another row, beside greedy, filtered and unfiltered rows.
    sampler = Sampler()
    target = Sequence("t", [1], params)
    others = seqs_with(SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=9),
                       SamplingParams(temperature=2.0, top_p=0.3, seed=5, logprobs=True))
    batched = []
    for i in range(20):
        batch = others[: i % 4] + [target] + others[i % 4:]
        rows = random_logits(len(batch), seed=100 + i)
        rows[i % 4] = logits
        tokens, _ = sampler.sample(rows, batch)
        batched.append(tokens[i % 4])
        target.append_token(tokens[i % 4])
    assert batched == alone


def test_different_seeds_differ_and_unseeded_follow_torch_manual_seed():
    logits = random_logits(1, seed=3)[0]
    assert draw(SamplingParams(seed=1), logits, 20) != draw(SamplingParams(seed=2), logits, 20)
    torch.manual_seed(0)
    first = draw(SamplingParams(), logits, 20)
    torch.manual_seed(0)
    assert draw(SamplingParams(), logits, 20) == first


def test_samples_follow_the_distribution_and_respect_the_filters():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.full((VOCAB,), -math.inf)
    logits[:4] = probs.log()
    counts = torch.bincount(torch.tensor(draw(SamplingParams(seed=0), logits, 4000)), minlength=VOCAB)
    assert torch.allclose(counts[:4] / 4000, probs, atol=0.03) and counts[4:].sum() == 0

    top2 = torch.tensor(draw(SamplingParams(seed=0, top_k=2), logits, 500))
    assert set(top2.tolist()) == {0, 1}
    assert abs((top2 == 0).float().mean().item() - 0.5 / 0.8) < 0.06
    # top_p=0.8: 0.5 + 0.3 reaches it, so token 2 (mass before it 0.8) is dropped.
    assert set(draw(SamplingParams(seed=0, top_p=0.8), logits, 500)) == {0, 1}
    assert set(draw(SamplingParams(seed=0, top_p=0.81), logits, 500)) == {0, 1, 2}
    # top_p applies to what top_k kept: of {0, 1, 2} (mass 0.95), 0.5 alone is below 0.55 * 0.95.
    assert set(draw(SamplingParams(seed=0, top_k=3, top_p=0.55), logits, 500)) == {0, 1}
    cold = draw(SamplingParams(seed=0, temperature=0.05), logits, 200)
    assert cold.count(0) == 200


def test_logprobs_are_of_the_raw_logits_before_temperature():
    logits = random_logits(3, seed=4)
    params = [SamplingParams(temperature=0.0, logprobs=True), SamplingParams(temperature=3.0, seed=1, logprobs=True),
              SamplingParams(temperature=0.5, seed=2)]
    tokens, logprobs = Sampler().sample(logits, seqs_with(*params))
    reference = torch.log_softmax(logits, dim=-1)
    assert logprobs[0] == pytest.approx(reference[0, tokens[0]].item())
    assert logprobs[1] == pytest.approx(reference[1, tokens[1]].item())
    assert logprobs[2] is None


def test_logits_must_have_one_row_per_sequence():
    with pytest.raises(ValueError, match=r"N = 2"):
        Sampler().sample(torch.zeros(3, VOCAB), seqs_with(SamplingParams(), SamplingParams()))


def test_params_defaults_and_normalisation():
    params = SamplingParams(stop=["\n\n", "###"], stop_token_ids=[2])
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (1.0, -1, 1.0, 16)
    assert params.stop == ("\n\n", "###") and params.stop_token_ids == (2,)
    assert SamplingParams(temperature=0).is_greedy and not params.is_greedy
    assert not SamplingParams(top_k=0).uses_top_k and SamplingParams(top_k=5).uses_top_k


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", "hot"),
    ("top_k", -2), ("top_k", 2.5), ("top_p", 0.0), ("top_p", 1.5),
    ("seed", 1.0), ("max_tokens", 0), ("max_tokens", True),
    ("stop", "END"), ("stop", [""]), ("stop_token_ids", [-1]), ("stop_token_ids", ["2"]),
    ("ignore_eos", 1), ("logprobs", "yes"),
])
def test_invalid_params_are_rejected_by_name(field, value):
    with pytest.raises(ValueError, match=rf"^{field} "):
        SamplingParams(**{field: value})


def test_greedy_picks_in_c_are_torch_argmax_ties_and_nans_included():
    """argmax_rows: the first of equal largest values, a NaN counting as largest (the first NaN), over rows
    split among threads (a tie across the split goes to the lower index)."""
    from runtime._native import _ops
    from runtime.core.sampler import argmax_rows

    g = torch.Generator().manual_seed(3)
    for n in (1, 7, 8, 33, 4096, 49157):
        x = torch.randn(4, n, generator=g)
        x[1] = -float("inf")
        x[2, n // 3] = x[2, -1] = 1e9  # a tie: the first
        if n > 1:
            x[3, n - 1], x[3, n // 2] = float("nan"), float("nan")
        expected = x.argmax(dim=-1)
        assert torch.equal(argmax_rows(x), expected), n
        for threads in (1, 2, 3):
            out = np.empty(4, dtype=np.int64)
            _ops.argmax_rows(out, x.numpy(), n, threads)
            assert out.tolist() == expected.tolist(), (n, threads)
    with pytest.raises(ValueError, match="argmax_rows: out must be int64"):
        _ops.argmax_rows(np.empty(2, dtype=np.int64), torch.zeros(3, 5).numpy(), 5, 1)


# widths that leave a partial vector of 8 at the end; a vocabulary-sized row with a few tokens far above
# the rest, as a model's logits have, where most vectors skip the log (race_row's bound)
@pytest.mark.parametrize("vocab, lead", [(13, 0.0), (64, 0.0), (1001, 0.0), (49157, 14.0)])
def test_the_race_in_c_is_argmax_of_probs_over_its_noise(vocab, lead):
    """sample_random (C, _ops.race_rows) against its definition in torch: softmax(logits / T) / race_noise."""
    from runtime.core.sampler import race_noise

    logits = torch.randn(24, vocab, generator=torch.Generator().manual_seed(vocab)) * 4
    logits[:, 1:9] += lead
    logits[:, 0] = -math.inf  # held back: never drawn
    seqs = seqs_with(*[SamplingParams(temperature=0.5 + 0.1 * i, seed=1000 + i) for i in range(24)])
    for i, seq in enumerate(seqs):
        for _ in range(i % 3):
            seq.append_token(1)  # other output positions: other noise
    got = Sampler().sample_random(logits, seqs)
    temperatures = torch.tensor([seq.params.temperature for seq in seqs]).unsqueeze(1)
    noise = torch.stack([race_noise(seq, seq.num_output_tokens, vocab) for seq in seqs])
    want = (torch.softmax(logits / temperatures, dim=-1) / noise).argmax(dim=-1)
    assert got.tolist() == want.tolist()
    assert (got > 0).all() and (got < vocab).all()
    # the filtered path gives the race probabilities, not logits: the same draws when the filters keep all
    kept_all = seqs_with(*[SamplingParams(temperature=0.5 + 0.1 * i, seed=1000 + i, top_k=vocab) for i in range(24)])
    for seq, other in zip(kept_all, seqs):
        seq.output_token_ids = list(other.output_token_ids)
    assert Sampler().sample_random(logits, kept_all).tolist() == want.tolist()


def test_race_noise_is_exponential_and_a_function_of_the_key_alone():
    from runtime.core.sampler import race_noise

    seq = Sequence("s", [1], SamplingParams(seed=7))
    noise = race_noise(seq, 3, 1 << 16)
    assert torch.equal(noise, race_noise(seq, 3, 1 << 16))
    assert torch.equal(noise[:100], race_noise(seq, 3, 100))  # token v's noise does not depend on the width
    assert not torch.equal(noise, race_noise(seq, 4, 1 << 16))
    assert (noise > 0).all() and torch.isfinite(noise).all()
    assert abs(noise.mean().item() - 1) < 0.02 and abs(noise.var().item() - 1) < 0.05  # Exp(1)
    assert abs((noise > 1).float().mean().item() - math.exp(-1)) < 0.01
