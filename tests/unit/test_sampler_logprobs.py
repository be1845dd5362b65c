"""Sampler: top log-probabilities (values, order, ties), min_p, logit_bias; and the params' validation of them."""

import pickle

import pytest
import torch

from runtime.core.sampler import Sampler, filter_top_k_top_p
from runtime.core.sampling import MAX_TOP_LOGPROBS, Logprob, SamplingParams
from runtime.core.sequence import Sequence
from runtime.core.speculative import Proposal


def seq_with(**params) -> Sequence:
    return Sequence("s", [1], SamplingParams(max_tokens=16, **params))


def test_top_logprobs_are_log_softmax_most_likely_first_ties_to_the_lower_id():
    logits = torch.tensor([[0.5, 2.0, -1.0, 2.0, 1.0, 0.0]])
    tokens, logprobs = Sampler().sample(logits, [seq_with(temperature=0.0, top_logprobs=4)])
    expected = torch.log_softmax(logits[0], dim=-1)
    assert tokens == [1] and isinstance(logprobs[0], Logprob)
    assert logprobs[0] == pytest.approx(expected[1].item())
    assert [t for t, _ in logprobs[0].top] == [1, 3, 4, 0]  # 2.0 twice: id 1 before id 3
    assert [v for _, v in logprobs[0].top] == pytest.approx(expected[[1, 3, 4, 0]].tolist())


def test_each_row_gets_its_own_number_of_alternatives_and_sampled_rows_too():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    seqs = [seq_with(temperature=0.0, top_logprobs=2), seq_with(temperature=0.0, logprobs=True),
            seq_with(temperature=1.0, seed=3, top_logprobs=20)]
    tokens, logprobs = Sampler().sample(logits, seqs)
    assert [len(lp.top) for lp in logprobs] == [2, 0, 20]
    expected = torch.log_softmax(logits[2], dim=-1)
    assert logprobs[2] == pytest.approx(expected[tokens[2]].item())
    assert [t for t, _ in logprobs[2].top] == expected.argsort(descending=True, stable=True)[:20].tolist()


def test_verified_guesses_carry_their_alternatives():
    rows = torch.randn(3, 20, generator=torch.Generator().manual_seed(1))
    guesses = rows.argmax(-1).tolist()[:2]
    seq = seq_with(temperature=0.0, top_logprobs=3)
    tokens, logprobs = Sampler().verify(rows, seq, Proposal(guesses))
    assert tokens == rows.argmax(-1).tolist() and [len(lp.top) for lp in logprobs] == [3, 3, 3]
    assert [lp.top[0][0] for lp in logprobs] == tokens


def test_a_logprob_pickles_with_its_alternatives():
    lp = pickle.loads(pickle.dumps(Logprob(-0.5, [(3, -0.5), (1, -2.0)])))
    assert lp == -0.5 and lp.top == ((3, -0.5), (1, -2.0)) and isinstance(lp, float)


def test_logit_bias_moves_greedy_and_min_p_keeps_only_the_likely():
    logits = torch.tensor([[3.0, 2.0, 0.0, 1.0]])
    assert Sampler().sample(logits, [seq_with(temperature=0.0, logit_bias={2: 5.0})])[0] == [2]
    assert Sampler().sample(logits, [seq_with(temperature=0.0, logit_bias={0: -100})])[0] == [1]
    probs = torch.softmax(logits, dim=-1)
    kept = filter_top_k_top_p(probs, [seq_with(temperature=1.0, min_p=0.3)])
    assert (kept[0] > 0).tolist() == [True, True, False, False]  # p(1) / p(0) = e^-1 = 0.37 >= 0.3
    assert kept[0, :2].tolist() == probs[0, :2].tolist()
    for seed in range(20):  # min_p 1: only the most likely token survives, whatever the draw
        assert Sampler().sample(logits, [seq_with(temperature=1.0, seed=seed, min_p=1.0)])[0] == [0]


@pytest.mark.parametrize("field, value", [("top_logprobs", MAX_TOP_LOGPROBS + 1), ("top_logprobs", -1),
                                          ("min_p", 1.5), ("min_p", "0.1"), ("logit_bias", {1: 101}),
                                          ("logit_bias", {-1: 1.0}), ("logit_bias", {"1": 1.0}), ("logit_bias", 3)])
def test_bad_values_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must"):
        SamplingParams(**{field: value})


def test_top_logprobs_implies_logprobs_and_bias_is_stored_sorted():
    params = SamplingParams(top_logprobs=2, logit_bias={5: 1.0, 2: -1})
    assert params.logprobs and params.logit_bias == ((2, -1), (5, 1.0)) and params.adjusts_logits
