"""Sampler: picks each sequence's next token from its logits row (greedy, temperature, top-k, top-p).

Every row depends only on its own logits, params, tokens and seed, never on the rest of the batch:
- first the row's penalties (repetition, presence, frequency; see SamplingParams) and logit_bias change its logits,
  and while fewer than min_tokens are generated the tokens that would stop it get -inf;
- greedy (temperature 0): argmax of the logits, ties to the lowest token id;
- otherwise probs = softmax(logits / temperature); min_p drops the tokens less likely than min_p times the
  most likely one; then top-k keeps the k most likely tokens and top-p
  the smallest most-likely-first set whose mass reaches top_p of what top-k kept (ties in order
  of token id, by a stable sort, so top_k=1 and a tiny top_p both equal greedy); the kept
  probabilities are never rescaled, so a row's numbers are the same whichever filters other rows use;
- the token is argmax(probs / e) with e ~ Exp(1) over the whole vocabulary, drawn from the
  sequence's stream for that output position (Sequence.noise_key: a counter-based hash of the key and
  the token id, race_noise): the exponential race, where token i wins with probability
  probs[i] / sum(probs). The same seed gives the same tokens in any batch, after preemption, with or
  without speculative decoding, and on any x86-64 CPU (the race's C code is the same AVX2 everywhere).
A sequence with speculative guesses has k + 1 rows and goes through verify(): each row's token is
chosen exactly as above for its position (argmax, or the race with that position's noise), and a
guess stands while it equals the token chosen at its position; the first that differs is replaced
by that token. A sampled request's output is therefore its non-speculative output, token for token
(runtime/core/speculative.py explains why this is speculative sampling's rejection rule). Speculation is
never given to requests with penalties or min_tokens pending, so those adjustments never meet guesses.
A sequence with a grammar (runtime/core/constraints.py) has every token its grammar does not allow next at -inf
after the penalties, and feeds the token chosen to its grammar.
Log-probs are log_softmax of the raw logits, before penalties, bias, temperature and filtering: the
model's own probability of the chosen token, comparable across requests whatever their sampling settings; a
constrained sequence's are taken after its grammar's mask, as OpenAI's structured outputs report them. The top
alternatives (top_logprobs) come from the same log_softmax: the k largest, ties to the lower token id.
"""

from __future__ import annotations

import numpy as np
import torch

from runtime._native import _ops
from runtime.core.constraints import mask_rows
from runtime.core.sampling import Logprob
from runtime.core.sequence import Sequence
from runtime.core.speculative import Proposal, accept_greedy
from runtime.ops.checks import threads


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest value (the first of equals; a NaN counts as largest, as torch's argmax
    has it). In C on the host, tens of microseconds faster a step than torch's argmax. One row runs on the
    calling thread: between steps the kernels' other threads have gone to sleep, and waking them costs more
    than they save."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or not logits.is_contiguous() or logits.dim() != 2:
        return logits.argmax(dim=-1)
    return torch.from_numpy(_argmax_rows_c(logits))


def _argmax_rows_c(logits: torch.Tensor) -> np.ndarray:
    """argmax_rows in C of a contiguous [N, V] float32 tensor on the host."""
    out = np.empty(logits.shape[0], dtype=np.int64)
    _ops.argmax_rows(out, logits.numpy(), logits.shape[1], 1 if logits.shape[0] == 1 else threads())
    return out


class Sampler:
    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float | None]]:
        """logits [N, V], one row per sequence -> (token ids, log-prob of each, None where not requested)."""
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"sample: logits must be [N, V] with N = {len(seqs)} sequences, "
                             f"got {tuple(logits.shape)}")
        logits = raw_logits = logits if logits.dtype == torch.float32 else logits.float()
        adjusted = [i for i, seq in enumerate(seqs)
                    if seq.params.adjusts_logits or seq.params.held_back_token_ids(seq.num_output_tokens)]
        constrained = [seq.constraint for seq in seqs]
        if not adjusted and logits.device.type == "cpu" and logits.is_contiguous() and all(
                seq.params.is_greedy and not seq.params.logprobs for seq in seqs):
            # The common decode step (greedy, nothing asked beyond the token): no torch op after the logits,
            # each of which costs microseconds on the caches the step has just evicted.
            return _argmax_rows_c(logits).tolist(), [None] * len(seqs)
        if adjusted:
            logits = logits.clone()
            for i in adjusted:
                _adjust(logits[i], seqs[i])
            if any(c is not None for c in constrained):
                mask_rows(logits, constrained)
                if any(c is not None and seq.params.logprobs for c, seq in zip(constrained, seqs)):
                    raw_logits = raw_logits.clone()  # its log-probs are taken after the mask
                    mask_rows(raw_logits, constrained)
        tokens = torch.empty(len(seqs), dtype=torch.int64)
        greedy = [i for i, seq in enumerate(seqs) if seq.params.is_greedy]
        random = [i for i, seq in enumerate(seqs) if not seq.params.is_greedy]
        if len(greedy) == len(seqs):  # all greedy: no copy of the rows
            tokens = argmax_rows(logits)
        elif greedy:
            tokens[greedy] = logits[greedy].argmax(dim=-1)
        if random:
            tokens[random] = self.sample_random(logits[random], [seqs[i] for i in random])
        token_list = tokens.tolist()
        for constraint, token in zip(constrained, token_list):
            if constraint is not None:
                constraint.take(token)
        logprobs: list[float | None] = [None] * len(seqs)
        wanted = [i for i, seq in enumerate(seqs) if seq.params.logprobs]
        if wanted:
            found = token_logprobs(raw_logits[wanted], tokens[wanted], max(seqs[i].params.top_logprobs for i in wanted))
            for i, lp in zip(wanted, found):
                logprobs[i] = Logprob(lp, lp.top[:seqs[i].params.top_logprobs])
        return token_list, logprobs

    def verify_batch(self, logits: torch.Tensor, seqs: list[Sequence], proposals: list[Proposal]) -> tuple[list, list]:
        """A step with guesses: k + 1 logits rows for each sequence with k guesses (verify()), one for every
        other (sampled together, as in sample()). Per sequence: a token, or the list of tokens a verified
        sequence emits; and its log-prob(s), None where not requested."""
        tokens: list = [None] * len(seqs)
        logprobs: list = [None] * len(seqs)
        plain, plain_rows, row = [], [], 0
        for i, (seq, proposal) in enumerate(zip(seqs, proposals)):
            k = len(proposal.tokens)
            if k:
                tokens[i], logprobs[i] = self.verify(logits[row:row + k + 1], seq, proposal)
            else:
                plain.append(i)
                plain_rows.append(row)
            row += k + 1
        if row != logits.shape[0]:
            raise ValueError(f"verify_batch: {row} logits rows expected, got {logits.shape[0]}")
        if plain:
            sampled, lps = self.sample(logits[plain_rows], [seqs[i] for i in plain])
            for i, token, lp in zip(plain, sampled, lps):
                tokens[i], logprobs[i] = token, lp
        return tokens, logprobs

    def verify(self, rows: torch.Tensor, seq: Sequence, proposal: Proposal) -> tuple[list[int], list[float] | None]:
        """rows [k + 1, V]: logits after seq's last token and each of its k guesses -> (the tokens the step
        emits, their log-probs when requested)."""
        rows = rows.float()
        if seq.params.is_greedy:
            tokens = accept_greedy(proposal.tokens, rows.argmax(dim=-1).tolist())
        else:  # row by row: the rows after the first rejected guess need no noise
            tokens = []
            for i, guess in enumerate(proposal.tokens + [None]):
                tokens.append(int(self.sample_random(rows[i:i + 1], [seq], i)[0]))
                if tokens[-1] != guess:
                    break
        if not seq.params.logprobs:
            return tokens, None
        return tokens, token_logprobs(rows[:len(tokens)], torch.tensor(tokens), seq.params.top_logprobs)

    def sample_random(self, logits: torch.Tensor, seqs: list[Sequence], offset: int = 0) -> torch.Tensor:
        """logits [R, V] of rows with temperature > 0 -> sampled token ids [R]; row r samples output
        position seqs[r].num_output_tokens + offset. The race runs in C (_ops.race_rows), a thread per row:
        5x faster than torch's softmax, a seeded torch.rand per row and the division (32 rows of 49,152)."""
        rows = logits.float().contiguous()
        temperatures = np.array([seq.params.temperature for seq in seqs], dtype=np.float32)
        given_probs = any(seq.params.uses_top_k or seq.params.uses_top_p or seq.params.uses_min_p for seq in seqs)
        if given_probs:  # the filters need the probabilities themselves; the race then takes them as they are
            probs = torch.softmax(rows / torch.from_numpy(temperatures).unsqueeze(1), dim=-1)  # [R, V]
            rows = filter_top_k_top_p(probs, seqs).contiguous()
        keys = np.array([seq.noise_key(seq.num_output_tokens + offset) for seq in seqs], dtype=np.uint64)
        out = np.empty(len(seqs), dtype=np.int64)
        _ops.race_rows(out, rows.numpy(), temperatures, keys, rows.shape[1], int(given_probs),
                       1 if len(seqs) == 1 else threads())
        return torch.from_numpy(out)


def race_noise(seq: Sequence, output_index: int, vocab: int) -> torch.Tensor:
    """The Exp(1) draws [vocab] of seq's exponential race at an output position: the same every time, and
    what the race in sample_random divides by. Between 3e-8 and 17.3, never 0, so probs / noise is finite."""
    out = torch.empty(vocab, dtype=torch.float32)
    _ops.race_noise(out.numpy(), seq.noise_key(output_index))
    return out


def token_logprobs(rows: torch.Tensor, tokens: torch.Tensor, top: int) -> list[Logprob]:
    """rows [R, V] of raw logits and the token chosen from each -> its log-prob under log_softmax, with the
    row's `top` most likely tokens (ties to the lower id: a stable sort)."""
    logp = torch.log_softmax(rows.float(), dim=-1)
    chosen = logp.gather(1, tokens.view(-1, 1).long()).squeeze(1).tolist()
    if not top:
        return [Logprob(value) for value in chosen]
    values, ids = torch.sort(logp, dim=-1, descending=True, stable=True)
    values, ids = values[:, :top].tolist(), ids[:, :top].tolist()
    return [Logprob(value, zip(i, v)) for value, i, v in zip(chosen, ids, values)]


def filter_top_k_top_p(probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """probs [R, V] -> probs with what min-p, top-k and top-p drop (each row by its seq's params) zeroed; the
    kept values are unchanged."""
    vocab = probs.shape[1]
    min_p = torch.tensor([seq.params.min_p for seq in seqs], dtype=torch.float32).unsqueeze(1)
    probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    top_k = torch.tensor([seq.params.top_k if seq.params.uses_top_k else vocab for seq in seqs])
    top_p = torch.tensor([seq.params.top_p for seq in seqs], dtype=torch.float32)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)  # [R, V]
    ranks = torch.arange(vocab).unsqueeze(0)  # [1, V]
    sorted_probs = sorted_probs.masked_fill(ranks >= top_k.unsqueeze(1), 0.0)
    cumulative = sorted_probs.cumsum(dim=-1)
    mass_before = cumulative - sorted_probs  # mass of the more likely tokens; 0 for the first
    threshold = (top_p * cumulative[:, -1]).unsqueeze(1)
    drop = (mass_before >= threshold) & (top_p < 1.0).unsqueeze(1)
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)


def _adjust(row: torch.Tensor, seq: Sequence) -> None:
    """Apply seq's logit_bias, penalties and min_tokens to its logits row [V], in place."""
    params, vocab = seq.params, row.shape[0]
    if params.logit_bias:
        ids = [t for t, _ in params.logit_bias if t < vocab]
        row[ids] += torch.tensor([b for t, b in params.logit_bias if t < vocab], dtype=row.dtype)
    if params.uses_penalties:
        counts = torch.bincount(torch.tensor(seq.output_token_ids, dtype=torch.int64), minlength=vocab)  # [V]
        if params.repetition_penalty != 1.0:
            seen = counts > 0
            seen[torch.tensor(seq.prompt_token_ids, dtype=torch.int64)] = True
            penalty = params.repetition_penalty
            row.copy_(torch.where(seen, torch.where(row > 0, row / penalty, row * penalty), row))
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    held_back = [t for t in params.held_back_token_ids(seq.num_output_tokens) if t < vocab]
    if held_back:
        row[held_back] = float("-inf")
