"""Speculative decoding's proposer and acceptance rules (runtime/speculative.py), before any engine runs them."""

import pytest
import torch

from runtime.speculative import AdaptiveK, NgramIndex, NgramProposer, accept_greedy, accept_sampled

# The chi-square statistic of N draws over 5 tokens against their expected counts has 4 degrees of
# freedom; it exceeds 18.47 with probability 0.001 when the draws follow the expected distribution. The
# generators are seeded, so each test is deterministic; a wrong rule (accepting guesses at q's rate, or
# resampling from p instead of the residual) moves the statistic into the hundreds at N = 8000.
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


@pytest.mark.parametrize("draft", ["distribution", "one-hot"])
def test_sampled_tokens_follow_the_target_distribution(draft):
    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.1, 0.1, 0.6, 0.1, 0.1]])
    q = torch.tensor([[0.05, 0.6, 0.05, 0.2, 0.1]])
    generator = torch.Generator().manual_seed(0)
    first = torch.zeros(5)
    for _ in range(DRAWS):
        if draft == "distribution":
            guess = int(torch.multinomial(q[0], 1, generator=generator))
            tokens = accept_sampled([guess], p, q, generator)
        else:
            tokens = accept_sampled([1], p, None, generator)  # an n-gram guess: always token 1
        first[tokens[0]] += 1
    assert chi_square(first, p[0]) < CHI2_4DOF_999, first


def test_a_seeded_sampled_step_reproduces():
    p = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(1)), dim=-1)
    runs = [accept_sampled([3, 7, 9], p, None, torch.Generator().manual_seed(42)) for _ in range(2)]
    assert runs[0] == runs[1] and 1 <= len(runs[0]) <= 4


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
