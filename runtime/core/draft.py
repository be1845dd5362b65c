"""DraftProposer: a second, smaller Kiln engine guesses the target's next tokens (speculative decoding).

The draft runs in this process on its own KV cache and block pool, one rank, the cpu backend. Each
target sequence it speculates for has a draft sequence: the same tokens, the draft's own block
table, and how many of them the draft has computed. A proposal round for a batch is k draft steps:
the first computes every sequence's tokens the draft has not seen (the whole prompt the first time;
afterwards the tokens accepted since the last round, and the target's own token) and guesses the
next token from its last logits; each further step decodes the previous guess. Guesses are the
draft's argmax for greedy requests; for sampled ones, the draft's own exponential race (its
probabilities under the request's temperature, top-k and top-p) with the noise the target will
use at that output position, so where draft and target nearly agree the guess is the target's draw.

After the target verifies, the draft's cache is right up to the tokens both agree on: a new round
first cuts the draft sequence back to its longest common prefix with the target's tokens, so the
K/V of rejected guesses is simply overwritten. A sequence the draft has no blocks for gets no guesses.
"""

from __future__ import annotations

from pathlib import Path

import torch

from runtime.backends.base import create_executor
from runtime.format.engine_format import EngineDir, EngineError
from runtime.backends import open_engine
from runtime.backends import backend as backend_module
from runtime.core.kv_cache import BlockManager
from runtime.core.sampler import Sampler
from runtime.core.scheduler import ScheduledBatch
from runtime.core.sampling import SamplingParams
from runtime.core.sequence import Sequence
from runtime.core.speculative import Proposal
from runtime.backends.step import build_step_metadata

# A draft sequence never samples with its own seed; a fixed one keeps torch's global generator untouched.
_DRAFT_PARAMS = SamplingParams(seed=0)

# The draft's KV budget when the draft's build planned none smaller: it holds only the sequences in flight.
DRAFT_KV_GIB = 0.5


class DraftProposer:
    def __init__(self, path: str | Path, target: EngineDir, kv_cache_gib: float | None = None,
                 num_threads: int | None = None):
        draft = open_engine(path)
        manifest = draft.manifest
        if manifest.world_size != 1 or not backend_module(draft.backend).DRAFTS:
            raise EngineError(f"draft engine {path}: must be a one-rank cpu engine (it is {manifest.target}, "
                              f"{manifest.world_size} rank(s))")
        if (draft.path / "tokenizer.json").read_bytes() != (target.path / "tokenizer.json").read_bytes():
            raise EngineError(f"draft engine {path}: its tokenizer differs from the target's; a draft must share "
                              "the target's tokenizer")
        if manifest.vocab_size != target.manifest.vocab_size:
            raise EngineError(f"draft engine {path}: vocabulary {manifest.vocab_size} differs from the target's "
                              f"{target.manifest.vocab_size}")
        self.engine = draft
        self.max_seq_len = manifest.limits.max_seq_len
        # one pool: the draft's own block handling reads every layer through one table
        pools = manifest.kv_groups(kv_cache_gib if kv_cache_gib is not None else DRAFT_KV_GIB, windowed=False)
        self.executor = create_executor(draft, 0, pools, draft.backend, num_threads)
        self.block_size = manifest.block_size
        self.blocks = BlockManager(self.executor.cache.num_blocks, self.block_size, enable_prefix_caching=False)
        self.seqs: dict[str, Sequence] = {}  # target request id -> the draft's sequence
        self.steps = 0

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        guesses: dict[int, list[int]] = {i: [] for i in range(len(seqs))}
        drafts = {i: self._draft_of(seq, k) for i, (seq, k) in enumerate(zip(seqs, ks))}
        active = [i for i, d in drafts.items() if d is not None]
        for step in range(max((ks[i] for i in active), default=0)):
            active = [i for i in active if len(guesses[i]) < ks[i]]
            if not active:
                break
            batch = ScheduledBatch(tuple(drafts[i] for i in active),
                                   tuple(drafts[i].num_pending_tokens for i in active), (True,) * len(active))
            logits = self.executor.execute(build_step_metadata(batch, self.block_size)).float()
            self.steps += 1
            for row, i in enumerate(active):
                draft, target = drafts[i], seqs[i]
                draft.num_computed_tokens = draft.num_tokens
                token = self._pick(logits[row], target, len(guesses[i]))
                guesses[i].append(token)
                draft.append_token(token)
        return [Proposal(guesses[i]) for i in range(len(seqs))]

    def release(self, seq: Sequence) -> None:
        draft = self.seqs.pop(seq.request_id, None)
        if draft is not None:
            self.blocks.free(draft)

    def _draft_of(self, seq: Sequence, k: int) -> Sequence | None:
        """The draft sequence of `seq`, cut back to what agrees with seq's tokens and holding blocks for
        its k guesses; None when the draft cannot take it (too long, or no blocks free)."""
        tokens = seq.token_ids
        if len(tokens) + k > self.max_seq_len:
            return None
        draft = self.seqs.get(seq.request_id)
        if draft is None:
            draft = self.seqs[seq.request_id] = Sequence(seq.request_id, tokens, _DRAFT_PARAMS)
        else:
            common = 0
            limit = min(draft.num_computed_tokens, len(tokens))
            while common < limit and draft.token_ids[common] == tokens[common]:
                common += 1
            # The last token is always computed again: its logits give the first guess (the draft may have
            # computed it already, as a guess the scheduler cut for want of blocks and the target then chose).
            draft.num_computed_tokens = min(common, len(tokens) - 1)
            draft.token_ids = list(tokens)
        needed = self.blocks.blocks_needed(len(tokens) + k - 1) - len(draft.block_table)
        if needed > self.blocks.num_free_blocks:
            self.release(seq)
            return None
        self.blocks.append_slots(draft, len(tokens) + k - 1)
        return draft

    @staticmethod
    def _pick(row: torch.Tensor, target: Sequence, offset: int) -> int:
        """The guess for target's output position num_output_tokens + offset from the draft's logits row."""
        params = target.params
        if params.is_greedy:
            return int(row.argmax())
        return int(Sampler().sample_random(row.unsqueeze(0), [target], offset)[0])
