"""Speculative decoding: proposers, the acceptance rules, adaptive k, and the Speculator the scheduler asks.

A proposer guesses the next k tokens of a sequence cheaply; the target engine then scores the last
token and the k guesses in one step (k + 1 positions for one read of the weights), and the rules
here decide which guesses stand:

- greedy: a guess stands while it equals the target's argmax at its position; the first mismatch is
  replaced by the target's own token, and if all k stand the target's token after them is a bonus.
  The output is the target's greedy output, token for token.
- sampled: the target samples every position as it would without guesses (the exponential race
  with that position's own noise, runtime/core/sampler.py), and a guess stands while it equals the
  target's token at its position. For a proposer that guesses one token x (n-gram lookup, and the
  draft engine too), this is the rejection rule of speculative sampling (Leviathan et al. 2023;
  Chen et al. 2023) with q all on x: x stands with probability p(x), and after a rejection the
  token is distributed as p without x, renormalised. The rule is realised with the target's own
  draw, so a seeded request emits exactly its non-speculative tokens, whatever k and the batch.
  The draft engine picks its guess with the same position's noise over its own distribution, so
  it guesses the target's draw whenever the two distributions are close.

Where it runs: Scheduler.schedule() gives each decoding sequence k guesses from the Speculator
(within the step's token budget and the free KV blocks: a guess never preempts anyone), the step
carries them as a query chunk of k + 1 tokens with logits at every position, LLMEngine._complete
applies the rule, and Scheduler.postprocess() keeps the emitted tokens and releases the blocks
that only rejected guesses used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    from runtime.core.sequence import Sequence

PROPOSERS = ("ngram", "draft")


class Proposal(NamedTuple):
    tokens: list[int]  # the guesses, at most the k asked for; [] for none


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        """Up to ks[i] guesses continuing seqs[i].token_ids, for every i (each ks[i] >= 1)."""

    def release(self, seq: Sequence) -> None:
        """Forget what is kept for a sequence that finished."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """proposer: "ngram" (prompt lookup) or "draft" (the Kiln engine at draft_engine); max_k caps the
    guesses per step, and adaptive chooses each sequence's k below it (AdaptiveK; False: always max_k);
    ngram_min / ngram_max bound the n-gram lengths looked up."""

    proposer: str = "ngram"
    max_k: int = 4
    adaptive: bool = True
    draft_engine: str | None = None
    ngram_min: int = 1
    ngram_max: int = 4

    def __post_init__(self) -> None:
        if self.proposer not in PROPOSERS:
            raise ValueError(f"speculative proposer {self.proposer!r}: choose one of {', '.join(PROPOSERS)}")
        if not isinstance(self.max_k, int) or not 1 <= self.max_k <= 16:
            raise ValueError(f"speculative max_k must be an integer in [1, 16], got {self.max_k!r}")
        if (self.proposer == "draft") != (self.draft_engine is not None):
            raise ValueError("the draft proposer needs a draft engine, and only it takes one")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"ngram lookup: need 1 <= min <= max, got {self.ngram_min}, {self.ngram_max}")


# ------------------------------------------------------------------------------------- n-gram lookup

class NgramIndex:
    """The latest end position of every n-gram (min_n..max_n tokens) of a growing token list, except
    the n-grams ending at its last token: those are the suffix being looked up. Kept per sequence and
    extended by the tokens appended since the last call, so a lookup costs O(max_n), not a scan."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.ends: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in `ends`

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """What followed the latest earlier occurrence of the longest suffix n-gram (up to k tokens)."""
        last = len(token_ids) - 1
        for end in range(self.indexed, last):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self.ends[tuple(token_ids[end - n + 1:end + 1])] = end
        self.indexed = max(self.indexed, last)
        for n in range(min(self.max_n, last), self.min_n - 1, -1):
            end = self.ends.get(tuple(token_ids[last - n + 1:]))
            if end is not None:
                return token_ids[end + 1:end + 1 + k]
        return []


@dataclass(frozen=True)
class NgramProposer:
    """Prompt lookup: the longest recent n-gram (max_n down to min_n tokens) that ends the sequence and
    occurred earlier in it; the tokens that followed its latest earlier occurrence are the guess.
    Strong where the output copies its input (summaries, rewrites, code edits); no second model."""

    min_n: int = 1
    max_n: int = 4
    indexes: dict = field(default_factory=dict, compare=False, repr=False)  # request id -> NgramIndex

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"ngram proposer: need 1 <= min_n <= max_n, got {self.min_n}, {self.max_n}")

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """The guess for a token list on its own (no index kept)."""
        return NgramIndex(self.min_n, self.max_n).lookup(token_ids, k)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        out = []
        for seq, k in zip(seqs, ks):
            index = self.indexes.get(seq.request_id)
            if index is None:
                index = self.indexes[seq.request_id] = NgramIndex(self.min_n, self.max_n)
            out.append(Proposal(index.lookup(seq.token_ids, k)))
        return out

    def release(self, seq: Sequence) -> None:
        self.indexes.pop(seq.request_id, None)


# ------------------------------------------------------------------------------------- acceptance

def accept_greedy(proposed: list[int], target_argmax: list[int]) -> list[int]:
    """The tokens a greedy step emits: target_argmax[i] is the target's choice after the last token and
    proposed[:i] (len(proposed) + 1 entries). Guesses stand while they equal it; then one target token."""
    if len(target_argmax) != len(proposed) + 1:
        raise ValueError(f"accept_greedy: {len(proposed)} guesses need {len(proposed) + 1} target tokens, "
                         f"got {len(target_argmax)}")
    out = []
    for guess, choice in zip(proposed, target_argmax):
        out.append(choice)
        if guess != choice:
            return out
    out.append(target_argmax[-1])
    return out


# A guess is never worth less than this many tokens of step time (the proposal and the verification's
# own bookkeeping), so guesses that almost never stand turn speculation off even on a free step.
MIN_GUESS_COST = 0.1


@dataclass
class AdaptiveK:
    """k for one sequence: as many guesses as are worth their cost.

    The chance that a guess stands is estimated from the sequence's recent steps (exponentially
    weighted; each step shows `accepted` standing guesses and one rejection unless all stood), and
    the k-th guess stands only if all before it did: it adds acceptance^k tokens on average. `cost`
    is what one more token in the step costs, in tokens of output at the step's current rate
    (StepCost); k is the largest with acceptance^k above it. At k = 0 a one-guess probe every
    `probe_every` steps keeps the estimate fresh, so a sequence that starts copying its input is noticed.
    """

    max_k: int = 4
    decay: float = 0.8
    probe_every: int = 32
    stood: float = 1.6    # prior: 0.8 of two guesses
    judged: float = 2.0
    _off_steps: int = field(default=0, repr=False)

    @property
    def acceptance(self) -> float:
        return self.stood / self.judged

    def k(self, cost: float = MIN_GUESS_COST) -> int:
        a, k = self.acceptance, 0
        while k < self.max_k and a ** (k + 1) > max(cost, MIN_GUESS_COST):
            k += 1
        if k:
            self._off_steps = 0
            return k
        self._off_steps += 1
        if self._off_steps < self.probe_every:
            return 0
        self._off_steps = 0
        return 1

    def update(self, proposed: int, accepted: int) -> None:
        if proposed:
            self.stood = self.decay * self.stood + accepted
            self.judged = self.decay * self.judged + accepted + (accepted < proposed)


class StepCost:
    """What one more token costs in a step of decodes: step time ~ fixed + per_token * tokens, fitted by
    exponentially weighted least squares over recent steps that carried no prefill.

    guess_cost(decoding, tokens): a guess adds per_token seconds to a step that emits about `decoding`
    tokens in fixed + per_token * tokens; in tokens of output at that rate it costs
    per_token * decoding / (fixed + per_token * tokens). One sequence on a memory-bound device pays
    little; a batch whose step is already compute-bound pays about one token per guess, which only
    guesses that almost always stand repay. Before two different token counts are seen, per_token is
    taken as PRIOR_RATIO of the fixed part.
    """

    PRIOR_RATIO = 0.1

    def __init__(self, decay: float = 0.95):
        self.decay = decay
        self.w = self.st = self.st2 = self.sy = self.sty = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        d = self.decay
        self.w, self.st, self.st2 = d * self.w + 1, d * self.st + tokens, d * self.st2 + tokens * tokens
        self.sy, self.sty = d * self.sy + seconds, d * self.sty + tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None before two different token counts are seen."""
        if self.w == 0:
            return None
        mean_t, mean_y = self.st / self.w, self.sy / self.w
        var = self.st2 / self.w - mean_t ** 2
        if var < 1e-6 * max(mean_t ** 2, 1.0):
            return None
        per_token = max((self.sty / self.w - mean_t * mean_y) / var, 0.0)
        return max(mean_y - per_token * mean_t, 0.0), per_token

    def guess_cost(self, decoding: int, tokens: int) -> float:
        fitted = self.fit()
        fixed, per_token = fitted if fitted is not None else (1.0, self.PRIOR_RATIO)
        total = fixed + per_token * tokens
        return per_token * decoding / total if total > 0 else 1.0


# ------------------------------------------------------------------------------------- the speculator

@dataclass
class SpeculationStats:
    proposed_tokens: int = 0  # guesses verified
    accepted_tokens: int = 0  # of those, the ones that stood
    spec_steps: int = 0       # sequence-steps that verified at least one guess
    emitted_tokens: int = 0   # tokens those sequence-steps emitted (accepted + one each)


class Speculator:
    """Chooses each decoding sequence's k (AdaptiveK, the request's max_tokens, the step's budget) and
    asks the proposer; records what was accepted. Requests with penalties, or still held back by
    min_tokens, or that opted out (SamplingParams.speculative=False), decode one token at a time."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer):
        self.config, self.proposer = config, proposer
        self.stats = SpeculationStats()
        self.step_cost = StepCost()
        # Acceptance over every sequence's recent steps: a new sequence starts from it (with the weight of
        # two guesses), so a workload whose guesses mostly fail does not pay for a fresh optimist each time.
        self.pooled = AdaptiveK(decay=0.95)

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A step of decodes only (no prefill) took `seconds` for `tokens` tokens, guesses included."""
        self.step_cost.observe(tokens, seconds)

    def propose(self, seqs: list[Sequence], budget: int, step_tokens: int | None = None) -> list[Proposal]:
        """A proposal for every sequence (empty for those not speculating); at most `budget` guesses in all.
        step_tokens: the tokens the step carries without guesses (default: one per sequence)."""
        cost = self.step_cost.guess_cost(len(seqs), step_tokens or len(seqs))
        ks = []
        for seq in seqs:
            k = 0
            if budget > 0 and _may_speculate(seq):
                if seq.adaptive_k is None:
                    seq.adaptive_k = AdaptiveK(max_k=self.config.max_k, stood=2 * self.pooled.acceptance, judged=2.0)
                k = min(seq.adaptive_k.k(cost) if self.config.adaptive else self.config.max_k, budget, seq.params.max_tokens - seq.num_output_tokens - 1)
            ks.append(max(k, 0))
            budget -= ks[-1]
        asked = [i for i, k in enumerate(ks) if k]
        proposals = [Proposal([])] * len(seqs)
        if asked:
            for i, proposal in zip(asked, self.proposer.propose([seqs[i] for i in asked], [ks[i] for i in asked])):
                proposals[i] = proposal
        return proposals

    def record(self, seq: Sequence, proposed: int, emitted: int) -> None:
        """A verified step of seq: `proposed` guesses, `emitted` tokens kept (accepted guesses + 1, or
        fewer when the request stopped part-way)."""
        if not proposed:
            return
        accepted = min(emitted, proposed + 1) - 1
        seq.adaptive_k.update(proposed, accepted)
        self.pooled.update(proposed, accepted)
        seq.num_proposed_tokens += proposed
        seq.num_accepted_tokens += accepted
        self.stats.proposed_tokens += proposed
        self.stats.accepted_tokens += accepted
        self.stats.spec_steps += 1
        self.stats.emitted_tokens += emitted

    def release(self, seq: Sequence) -> None:
        self.proposer.release(seq)


def _may_speculate(seq: Sequence) -> bool:
    params = seq.params
    return (params.speculative and not params.adjusts_logits
            and not params.held_back_token_ids(seq.num_output_tokens))
