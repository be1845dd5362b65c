"""Speculative decoding's pieces that do not touch the engine: proposers, the acceptance rules, adaptive k.

A proposer guesses the next k tokens of a sequence cheaply; the target engine then scores the last
token and the k guesses in one step (k + 1 positions for one read of the weights), and the rules
here decide which guesses stand:

- greedy: a guess stands while it equals the target's argmax at its position; the first mismatch is
  replaced by the target's own token, and if all k stand the target's token after them is a bonus.
  The output is the target's greedy output, token for token.
- sampled: the rejection rule of speculative sampling (Leviathan et al. 2023; Chen et al. 2023):
  guess x drawn from the draft's q stands with probability min(1, p(x) / q(x)); a rejected position
  draws from max(0, p - q) renormalised. The emitted tokens are distributed as the target's p. A
  proposer without a distribution (n-gram lookup) is a q that puts all its mass on its guess.

Not wired into the scheduler yet (issue 18): this module is what that integration calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


class Proposer(Protocol):
    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k guessed continuations of token_ids (prompt + output so far); [] when it has none."""


@dataclass(frozen=True)
class NgramProposer:
    """Prompt lookup: the longest recent n-gram (max_n down to min_n tokens) that ends the sequence and
    occurred earlier in it; the tokens that followed its latest earlier occurrence are the guess.
    Strong where the output copies its input (summaries, rewrites, code edits); costs one scan."""

    min_n: int = 1
    max_n: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"ngram proposer: need 1 <= min_n <= max_n, got {self.min_n}, {self.max_n}")

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        length = len(token_ids)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = token_ids[length - n:]
            for start in range(length - n - 1, -1, -1):  # latest earlier occurrence first
                if token_ids[start:start + n] == suffix:
                    return token_ids[start + n:start + n + k]
        return []


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


def accept_sampled(proposed: list[int], target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                   generator: torch.Generator) -> list[int]:
    """The tokens a sampled step emits by the rejection rule.

    target_probs [k + 1, vocab]: p after the last token and each guess; draft_probs [k, vocab]: the
    draft's q for each guess, or None for a deterministic proposer (q one-hot on the guess). Uses the
    generator for every draw, so a seeded request reproduces.
    """
    k = len(proposed)
    if target_probs.shape[0] != k + 1 or (draft_probs is not None and draft_probs.shape[0] != k):
        raise ValueError(f"accept_sampled: {k} guesses need target_probs [{k + 1}, V] and draft_probs [{k}, V]")
    out = []
    for i, guess in enumerate(proposed):
        p = target_probs[i].double()
        q = draft_probs[i].double() if draft_probs is not None else None
        q_guess = 1.0 if q is None else float(q[guess])
        if float(torch.rand((), generator=generator, dtype=torch.float64)) * q_guess < float(p[guess]):
            out.append(guess)
            continue
        residual = p.clone()
        if q is None:
            residual[guess] = 0.0
        else:
            residual = (p - q).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p equals q: any draw from p will do
            residual = p
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[k].double(), 1, generator=generator)))
    return out


@dataclass
class AdaptiveK:
    """k for one sequence from its recent acceptance: an exponential average of accepted / proposed.
    Drops to 0 (no speculation) when guesses keep failing, and probes again every `probe_every` steps."""

    max_k: int = 4
    decay: float = 0.7
    off_below: float = 0.2
    probe_every: int = 16
    rate: float = 1.0
    _off_steps: int = field(default=0, repr=False)

    def k(self) -> int:
        if self.rate < self.off_below:
            self._off_steps += 1
            if self._off_steps < self.probe_every:
                return 0
            self._off_steps = 0
            return 1
        return max(1, min(self.max_k, round(self.rate * self.max_k + 0.5)))

    def update(self, proposed: int, accepted: int) -> None:
        if proposed:
            self.rate = self.decay * self.rate + (1 - self.decay) * accepted / proposed
