"""The device sampling kernels (runtime/backends/cuda/kernels/sampling.py) against the CPU sampler's rules,
run with Triton's interpreter. Tiles of 128 over V of 300-1000 so every loop runs several tiles and a ragged end."""

import pytest
import torch

from runtime.backends.cuda.kernels import sampling
from runtime.backends.cuda.launch import InterpreterLauncher, RecordingLauncher
from runtime.core.sampler import Sampler, _adjust, filter_top_k_top_p, race_noise
from runtime.core.sampling import SamplingParams
from runtime.core.sequence import Sequence

TILE = 128


def make_seq(params: SamplingParams, prompt, output) -> Sequence:
    seq = Sequence("s", list(prompt), params)
    seq.output_token_ids = list(output)
    seq.token_ids = seq.prompt_token_ids + seq.output_token_ids
    return seq


def penalty_lists(seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
    """The host's side: each row's distinct prompt and output ids [R, L] (-1 padding) and their output counts."""
    rows = [sorted(set(s.prompt_token_ids) | set(s.output_token_ids)) for s in seqs]
    width = max(len(r) for r in rows)
    ids = torch.full((len(seqs), width), -1, dtype=torch.int32)
    counts = torch.zeros((len(seqs), width), dtype=torch.int32)
    for i, (seq, row) in enumerate(zip(seqs, rows)):
        ids[i, :len(row)] = torch.tensor(row, dtype=torch.int32)
        counts[i, :len(row)] = torch.tensor([seq.output_token_ids.count(t) for t in row], dtype=torch.int32)
    return ids, counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_penalties_and_held_back_ids_equal_the_cpu_adjust(dtype):
    V, gen = 300, torch.Generator().manual_seed(0)
    settings = [(1.0, 0.0, 0.0), (1.3, 0.0, 0.0), (0.7, 0.5, -0.25), (1.0, -1.5, 2.0), (2.0, 2.0, 1.0)]
    seqs = []
    for i, (rep, freq, pres) in enumerate(settings):
        prompt = torch.randint(0, V, (5 + 7 * i,), generator=gen).tolist()
        output = torch.randint(0, V, (3 * i,), generator=gen).tolist() + prompt[:i]  # repeats, prompt ids again
        params = SamplingParams(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres,
                                min_tokens=4 * (i % 2), max_tokens=20, eos_token_ids=(7,), stop_token_ids=(11, 299))
        seqs.append(make_seq(params, prompt, output))
    logits = (torch.randn(len(seqs), V, generator=gen) * 4).to(dtype)
    expected = logits.float().clone()  # .float() of float32 logits is the same tensor
    for row, seq in zip(expected, seqs):
        _adjust(row, seq)
    ids, counts = penalty_lists(seqs)
    held = torch.full((len(seqs), 3), -1, dtype=torch.int32)
    for i, seq in enumerate(seqs):
        held_ids = seq.params.held_back_token_ids(seq.num_output_tokens)
        held[i, :len(held_ids)] = torch.tensor(held_ids, dtype=torch.int32)
    f32 = lambda values: torch.tensor(values, dtype=torch.float32)
    launcher = InterpreterLauncher()
    sampling.apply_penalties(launcher, logits, ids, counts, f32([s[0] for s in settings]),
                             f32([s[1] for s in settings]), f32([s[2] for s in settings]), list_tile=16)
    sampling.hold_back(launcher, logits, held, list_tile=16)
    if dtype == torch.bfloat16:  # the interpreter truncates float32 to bfloat16 (the GPU rounds): one ulp
        torch.testing.assert_close(logits.float(), expected, rtol=2.0**-7, atol=0.0)
    else:  # the same float32 operations in the same order, then one rounding to the logits' dtype: exact
        assert torch.equal(logits, expected.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_greedy_is_argmax_with_ties_to_the_lowest_id(dtype):
    V, gen = 700, torch.Generator().manual_seed(1)
    logits = torch.randn(6, V, generator=gen)
    logits[1, [5, 400, 650]] = 9.0           # ties in different tiles
    logits[2, [130, 131]] = 9.0              # ties in the same lane's neighbours
    logits[3, [699, 3]] = 9.0                # the later id in the last, ragged tile
    logits[4] = float("-inf")                # nothing finite: id 0, as torch.argmax
    logits[5, 256] = logits[5, 384] = 9.0    # the same lane in two tiles
    logits = logits.to(dtype)
    got = sampling.greedy(InterpreterLauncher(), logits, tile=TILE)
    assert got.dtype == torch.int32
    assert got.tolist() == logits.float().argmax(dim=-1).tolist()


def cpu_rows(V: int, gen: torch.Generator) -> tuple[torch.Tensor, list[Sequence]]:
    combos = [(1.0, -1, 1.0), (0.5, -1, 1.0), (1.7, -1, 1.0), (1.0, 5, 1.0), (1.5, 40, 1.0), (1.0, -1, 0.9),
              (2.0, -1, 0.5), (1.0, -1, 0.05), (1.3, 20, 0.8), (0.8, 1, 1.0), (1.0, 3, 0.3), (1.2, 250, 0.95)]
    seqs = [make_seq(SamplingParams(temperature=t, top_k=k, top_p=p, seed=100 * i + j), [1], [2] * (i + j))
            for i, (t, k, p) in enumerate(combos) for j in range(3)]
    return torch.randn(len(seqs), V, generator=gen) * 3, seqs


def device_args(seqs: list[Sequence], V: int):
    return (torch.tensor([s.params.temperature for s in seqs], dtype=torch.float32),
            torch.tensor([s.params.top_k if s.params.uses_top_k else 0 for s in seqs], dtype=torch.int32),
            torch.tensor([s.params.top_p for s in seqs], dtype=torch.float32),
            torch.tensor([s.seed for s in seqs], dtype=torch.int64),
            torch.tensor([s.num_output_tokens for s in seqs], dtype=torch.int32))


def test_sample_with_the_host_noise_equals_the_cpu_sampler():
    V = 500
    logits, seqs = cpu_rows(V, torch.Generator().manual_seed(2))
    expected = Sampler().sample_random(logits, seqs).tolist()
    noise = torch.stack([race_noise(s, s.num_output_tokens, V) for s in seqs])
    args = device_args(seqs, V)
    got = sampling.sample(InterpreterLauncher(), logits, *args, noise=noise, tile=TILE)
    assert got.tolist() == expected
    unfiltered = (torch.softmax(logits / args[0].unsqueeze(1), dim=-1) / noise).argmax(dim=-1)
    assert int((unfiltered != torch.tensor(expected)).sum()) >= 6, "the filters must change some draws"


def test_the_filters_cut_where_the_cpu_sampler_cuts():
    V = 500
    logits, seqs = cpu_rows(V, torch.Generator().manual_seed(5))
    temperature = torch.tensor([s.params.temperature for s in seqs]).unsqueeze(1)
    probs = torch.softmax(logits / temperature, dim=-1)
    noise = probs**2  # p / noise = 1 / p: the least likely token kept wins, so the token says where the cut is
    expected = (filter_top_k_top_p(probs, seqs) / noise).argmax(dim=-1)
    got = sampling.sample(InterpreterLauncher(), logits, *device_args(seqs, V), noise=noise, tile=TILE)
    assert got.tolist() == expected.tolist()


def test_top_k_1_and_a_tiny_top_p_are_greedy_and_filters_keep_ties_at_the_cut():
    V = 300
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(3))
    logits[2:, [17, 145]] = 6.0  # a tie for the top, in one lane (145 = 17 + TILE): top-k 1 keeps both
    temperature = torch.ones(4)
    top_k = torch.tensor([1, 0, 1, 0], dtype=torch.int32)
    top_p = torch.tensor([1.0, 1e-4, 1.0, 1e-4])
    got = sampling.sample(InterpreterLauncher(), logits, temperature, top_k, top_p,
                          torch.arange(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int32), tile=TILE)
    assert got[:2].tolist() == logits[:2].argmax(dim=-1).tolist()
    assert set(got[2:].tolist()) <= {17, 145}
    level = sampling.sample(InterpreterLauncher(), logits, temperature, top_k, top_p, torch.zeros(4, dtype=torch.int64),
                            torch.zeros(4, dtype=torch.int32), noise=torch.ones(4, V), tile=TILE)
    assert level.tolist() == logits.argmax(dim=-1).tolist()  # a tie in the race goes to the lowest id, as argmax
    noise = torch.ones(4, V)
    noise[:, 17] = 2.0  # 145 wins wherever it is kept
    tilted = sampling.sample(InterpreterLauncher(), logits, temperature, top_k, top_p, torch.zeros(4, dtype=torch.int64),
                             torch.zeros(4, dtype=torch.int32), noise=noise, tile=TILE)
    assert tilted[2:].tolist() == [145, 145]  # the tie at the cut is kept whole (the CPU keeps 17 alone)


def test_device_noise_depends_on_seed_and_position_only():
    V = 400
    logits, seqs = cpu_rows(V, torch.Generator().manual_seed(4))
    args = device_args(seqs, V)
    launcher = InterpreterLauncher()
    whole = sampling.sample(launcher, logits, *args, tile=TILE)
    picked = torch.tensor([20, 3, 11, 0, 35])
    alone = sampling.sample(launcher, logits[picked], *(a[picked] for a in args), tile=TILE)
    assert alone.tolist() == whole[picked].tolist()
    # one sequence, one logits row, 24 output positions: the draws differ from position to position
    flat = logits[:1].expand(24, V).contiguous() / 3
    temperature, top_k, top_p = torch.ones(24), torch.zeros(24, dtype=torch.int32), torch.ones(24)
    tokens = sampling.sample(launcher, flat, temperature, top_k, top_p, torch.full((24,), 7, dtype=torch.int64),
                             torch.arange(24, dtype=torch.int32), tile=TILE)
    assert len(set(tokens.tolist())) >= 12


def test_device_noise_draws_follow_the_probabilities():
    probs = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02])
    n, V = 800, probs.shape[0]
    logits = probs.log().expand(n, V).contiguous() * 0.5  # temperature 0.5 undoes the 0.5
    temperature = torch.full((n,), 0.5)
    top_k = torch.zeros(n, dtype=torch.int32)
    seeds = torch.arange(n, dtype=torch.int64) % 5           # 5 sequences ...
    positions = (torch.arange(n) // 5).to(torch.int32)       # ... 160 output positions each
    tokens = sampling.sample(InterpreterLauncher(), logits, temperature, top_k, torch.ones(n), seeds, positions,
                             tile=8)
    observed = torch.bincount(tokens.long(), minlength=V).double()
    expected = probs.double() * n
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 29.0  # 7 degrees of freedom: p < 1e-4 by chance


def test_variants_do_not_depend_on_the_batch_or_the_vocabulary():
    keys = []
    for R, V in ((2, 300), (5, 151936)):
        recorder = RecordingLauncher()
        logits = torch.empty(R, V, device="meta")
        f32, i32 = torch.empty(R, device="meta"), torch.empty(R, dtype=torch.int32, device="meta")
        sampling.greedy(recorder, logits)
        sampling.sample(recorder, logits, f32, i32, f32, torch.empty(R, dtype=torch.int64, device="meta"), i32)
        keys.append(set(recorder.seen))
    assert keys[0] == keys[1] and len(keys[0]) == 2
