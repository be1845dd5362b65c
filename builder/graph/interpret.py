"""Reference interpreter: a whole-prompt forward pass of one rank's program, no KV cache."""

from __future__ import annotations

import torch

from runtime.ops.program import Program, dense_hooks


class Interpreter:
    """Runs a single-rank program over one sequence; `all_logits` keeps every position's logits."""

    def __init__(self, program_json: str, tensors: dict[str, torch.Tensor], all_logits: bool = False):
        self.program = Program.from_json(program_json, tensors, dense_hooks(all_logits=all_logits))
        if any(n["op"] in ("all_reduce", "all_gather", "send", "recv") for n in self.program.doc["nodes"]):
            raise ValueError("the reference interpreter runs single-rank programs only")

    @torch.inference_mode()
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """[1, vocab] logits of the last token, or [T, vocab] with all_logits."""
        tokens = torch.tensor(token_ids, dtype=torch.int64)
        env = {"tokens": tokens, "positions": torch.arange(len(token_ids), dtype=torch.int64)}
        return self.program.run(env, release=True)[0]
