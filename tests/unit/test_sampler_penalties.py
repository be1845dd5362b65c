"""Sampler: repetition, presence and frequency penalties, and min_tokens holding back stop tokens and EOS."""

import pytest
import torch

from runtime.core.sampler import Sampler
from runtime.core.sampling import SamplingParams
from runtime.core.sequence import Sequence

VOCAB = 8
EOS = 7


def seq_with(params: SamplingParams, prompt=(1,), output=()) -> Sequence:
    seq = Sequence("s", list(prompt), params)
    for token in output:
        seq.append_token(token)
    return seq


def greedy_pick(logits: list[float], params: dict, prompt=(1,), output=()) -> int:
    seq = seq_with(SamplingParams(temperature=0.0, max_tokens=16, **params), prompt, output)
    return Sampler().sample(torch.tensor([logits]), [seq])[0][0]


@pytest.mark.parametrize("penalty, from_prompt, from_output", [(1.0, 1, 3), (1.4, 1, 3), (2.0, 4, 4)])
def test_repetition_penalty_divides_positive_logits_of_prompt_and_output_tokens(penalty, from_prompt, from_output):
    logits = [0.0, 3.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0]  # token 1 is the prompt: 3 / 1.4 > 2 > 3 / 2
    assert greedy_pick(logits, dict(repetition_penalty=penalty)) == from_prompt
    logits = [0.0, 0.0, 0.0, 3.0, 2.0, 0.0, 0.0, 0.0]  # token 3 was generated
    assert greedy_pick(logits, dict(repetition_penalty=penalty), output=(3,)) == from_output


@pytest.mark.parametrize("penalty, expected", [(1.4, 1), (2.0, 4)])
def test_repetition_penalty_multiplies_negative_logits(penalty, expected):
    logits = [-9.0, -1.0, -9.0, -9.0, -1.5, -9.0, -9.0, -9.0]  # -1 * 1.4 > -1.5 > -1 * 2
    assert greedy_pick(logits, dict(repetition_penalty=penalty)) == expected


def test_frequency_penalty_counts_generated_tokens_presence_penalty_does_not():
    logits = [0.0, 0.0, 0.0, 3.0, 0.0, 2.5, 2.0, 0.0]
    output = (3, 3, 5)  # token 3 twice, token 5 once; token 6 only in the prompt, never penalised
    assert greedy_pick(logits, dict(frequency_penalty=0.3), prompt=(6,), output=output) == 3  # 2.4 2.2 2.0
    assert greedy_pick(logits, dict(frequency_penalty=0.6), prompt=(6,), output=output) == 6  # 1.8 1.9 2.0
    assert greedy_pick(logits, dict(presence_penalty=0.6), prompt=(6,), output=output) == 3   # 2.4 1.9 2.0
    assert greedy_pick(logits, dict(presence_penalty=1.1), prompt=(6,), output=output) == 6   # 1.9 1.4 2.0
    # A negative penalty favours what was generated: 1 + 2 beats 2.
    assert greedy_pick([0.0, 0.0, 0.0, 1.0, 0.0, 2.0, 0.0, 0.0], dict(presence_penalty=-2.0), output=(3,)) == 3


def test_min_tokens_holds_back_eos_and_stop_token_ids_until_then():
    logits = torch.full((1, VOCAB), -1.0)
    logits[0, EOS], logits[0, 6], logits[0, 2] = 9.0, 8.0, 1.0
    params = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=3, stop_token_ids=[6], eos_token_ids=[EOS])
    for generated, expected in [(0, 2), (2, 2), (3, EOS)]:
        seq = seq_with(params, output=[2] * generated)
        assert Sampler().sample(logits, [seq])[0] == [expected], generated
    ignoring_eos = seq_with(SamplingParams(temperature=0.0, max_tokens=16, min_tokens=3, stop_token_ids=[6],
                                           eos_token_ids=[EOS], ignore_eos=True))
    assert Sampler().sample(logits, [ignoring_eos])[0] == [EOS]  # not a stop token then: nothing to hold back


def test_min_tokens_holds_back_eos_when_sampling_too():
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 20.0  # all but certain
    for seed in range(20):
        seq = seq_with(SamplingParams(temperature=1.0, seed=seed, max_tokens=16, min_tokens=1, eos_token_ids=[EOS]))
        assert Sampler().sample(logits, [seq])[0] != [EOS]


def test_logprobs_stay_those_of_the_raw_logits():
    logits = torch.tensor([[0.0, 3.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0]])
    seq = seq_with(SamplingParams(temperature=0.0, max_tokens=4, repetition_penalty=2.0, logprobs=True))
    tokens, logprobs = Sampler().sample(logits, [seq])
    assert tokens == [4] and logprobs[0] == pytest.approx(torch.log_softmax(logits[0], -1)[4].item())
    assert logits[0, 1] == 3.0  # the caller's logits are left alone


@pytest.mark.parametrize("fields", [dict(min_tokens=17), dict(min_tokens=-1), dict(repetition_penalty=0.0),
                                    dict(repetition_penalty=float("inf")), dict(presence_penalty=2.5),
                                    dict(frequency_penalty=-2.5), dict(eos_token_ids=[-1])])
def test_invalid_penalties_and_min_tokens_are_refused(fields):
    name = next(iter(fields))
    with pytest.raises(ValueError, match=name):
        SamplingParams(max_tokens=16, **fields)
