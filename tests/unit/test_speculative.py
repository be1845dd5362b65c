"""Speculative decoding's proposer and acceptance rules (runtime/core/speculative.py), before any engine runs them."""

import pytest
import torch

from runtime.core.sampler import Sampler
from runtime.core.sampling import SamplingParams
from runtime.core.sequence import Sequence
from runtime.core.speculative import (AdaptiveK, NgramIndex, NgramProposer, Proposal, SpeculativeConfig, Speculator,
                                  accept_greedy)

# The chi-square statistic of N draws over 5 tokens against their expected counts has 4 degrees of
# freedom; it exceeds 18.47 with probability 0.001 when the draws follow the expected distribution. The
# seeds are fixed, so each test is deterministic; a wrong rule (keeping the guess at its own rate, or
# resampling from p without removing the rejected guess) moves the statistic into the hundreds at N = 8000.
CHI2_4DOF_999 = 18.47
DRAWS = 8000


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    return float(((counts.double() - expected) ** 2 / expected).sum())


def test_ngram_proposes_what_followed_the_latest_longest_match():
    proposer = NgramProposer(max_n=3)
    assert proposer.lookup([1, 2, 3, 4, 9, 1, 2, 3], 3) == [4, 9, 1]
    # the latest earlier occurrence of the 2-gram (7, 8) wins over an older one
    assert proposer.lookup([7, 8, 1, 7, 8, 2, 5, 7, 8], 2) == [2, 5]
    # the longest suffix first: (5, 6) occurs with 0 after it, 6 alone with 9 after it
    assert proposer.lookup([6, 9, 5, 6, 0, 3, 5, 6], 1) == [0]
    assert proposer.lookup([1, 2, 3], 4) == []
    assert proposer.lookup([4, 4], 3) == [4]  # the match may run into the suffix itself, then stops at the end


def scan(token_ids, k, min_n, max_n):
    """The lookup by brute force: latest earlier occurrence of the longest suffix n-gram."""
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        for start in range(length - n - 1, -1, -1):
            if token_ids[start:start + n] == token_ids[length - n:]:
                return token_ids[start + n:start + n + k]
    return []


def test_the_incremental_index_agrees_with_a_scan_as_tokens_are_appended():
    generator = torch.Generator().manual_seed(3)
    for min_n, max_n in ((1, 4), (2, 3), (3, 3)):
        index = NgramIndex(min_n, max_n)
        tokens = torch.randint(0, 6, (40,), generator=generator).tolist()
        for length in range(1, 400):
            if length > len(tokens):
                tokens.append(int(torch.randint(0, 6, (1,), generator=generator)))
            if length % 3:  # lookups skip some lengths, as a sequence that does not speculate every step
                continue
            assert index.lookup(tokens[:length], 4) == scan(tokens[:length], 4, min_n, max_n), (min_n, max_n, length)


def test_greedy_acceptance_is_the_target_greedy_output():
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]   # all stand, plus a bonus token
    assert accept_greedy([5, 6, 7], [5, 9, 7, 8]) == [5, 9]         # the first mismatch takes the target's
    assert accept_greedy([], [3]) == [3]                            # no guesses: a plain decode
    with pytest.raises(ValueError, match="3 guesses need 4 target tokens"):
        accept_greedy([1, 2, 3], [1, 2, 3])


def plain_tokens(rows: torch.Tensor, params: SamplingParams) -> list[int]:
    """What a sequence samples from rows[0], rows[1], ... one token a step, without guesses."""
    seq = Sequence("plain", [1], params)
    for row in rows:
        seq.append_token(Sampler().sample(row.unsqueeze(0), [seq])[0][0])
    return seq.output_token_ids


def test_sampled_verification_emits_what_plain_sampling_would():
    rows = torch.randn(5, 40, generator=torch.Generator().manual_seed(1)) * 2
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=42)
    plain = plain_tokens(rows, params)
    assert len(set(plain)) > 1
    seq = Sequence("spec", [1], params)
    assert Sampler().verify(rows, seq, Proposal(plain[:4]))[0] == plain  # all stand, and the bonus token
    wrong = plain[:2] + [(plain[2] + 1) % 40, plain[3]]
    assert Sampler().verify(rows, seq, Proposal(wrong))[0] == plain[:3]  # the target's own token replaces it
    seq.append_token(plain[0])  # one step later the next position's noise is used
    assert Sampler().verify(rows[1:3], seq, Proposal(plain[1:2]))[0] == plain[1:3]


@pytest.mark.parametrize("draft", ["one token", "draft race"])
def test_sampled_verification_keeps_the_target_distribution(draft):
    """A guess of token 1 (an n-gram's) stands with probability p(1), and a draft guessing by its own race
    over q with the position's noise stands between (1 - TV) / (1 + TV) and 1 - TV of the time; the
    emitted token follows p either way."""
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    q = torch.tensor([0.05, 0.6, 0.05, 0.2, 0.1])
    rows = p.log().expand(2, 5)
    first, stood = torch.zeros(5), 0
    for seed in range(DRAWS):
        seq = Sequence("s", [1], SamplingParams(temperature=1.0, seed=seed))
        if draft == "one token":
            guess = 1
        else:
            guess = int(Sampler().sample_random(q.log().unsqueeze(0), [seq])[0])
        tokens = Sampler().verify(rows, seq, Proposal([guess]))[0]
        first[tokens[0]] += 1
        stood += tokens[0] == guess
    assert chi_square(first, p) < CHI2_4DOF_999, first
    rate, spread = stood / DRAWS, 4 * (0.25 / DRAWS) ** 0.5  # four standard deviations at most
    if draft == "one token":
        assert abs(rate - float(p[1])) < spread, rate
    else:
        tv = 0.5 * float((p - q).abs().sum())
        assert (1 - tv) / (1 + tv) - spread < rate < 1 - tv + spread, (rate, tv)


def test_adaptive_k_turns_itself_off_and_probes_again():
    k = AdaptiveK(max_k=4)
    assert k.k() == 4
    for _ in range(10):
        k.update(proposed=4, accepted=0)
    ks = [k.k() for _ in range(32)]
    assert ks.count(0) >= 28 and 1 in ks   # off, with a one-token probe now and then
    for _ in range(10):
        k.update(proposed=1, accepted=1)
    assert k.k() == 4


def test_a_new_sequence_starts_from_the_acceptance_the_others_saw():
    speculator = Speculator(SpeculativeConfig(max_k=4), NgramProposer())
    greedy = SamplingParams(temperature=0.0, max_tokens=100)
    first = Sequence("a", [5, 6, 7, 5, 6, 7, 5, 6], greedy)
    assert speculator.propose([first], budget=8)[0].tokens == [7, 5, 6]  # the prior: worth guessing
    for _ in range(20):
        speculator.record(first, proposed=4, emitted=1)  # none stood
    second = Sequence("b", [5, 6, 7, 5, 6, 7, 5, 6], greedy)
    assert speculator.propose([second], budget=8)[0].tokens == []
    assert second.adaptive_k.acceptance < 0.1 and speculator.stats.proposed_tokens == 80
