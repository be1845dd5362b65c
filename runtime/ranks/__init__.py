"""Ranks as processes: one per rank, joined over torch.distributed, their steps driven by rank 0.

Every rank runs its own program (rank{r}.engine) over the same steps and owns the KV cache of its
heads and layers. Rank 0 runs the scheduler and drives the steps (driver.py): for each step it
broadcasts the step metadata on the control group (collectives.py), runs its own program and takes
the logits. Every other rank loops (rank.py): receive a step, run it, and send the logits to rank 0
if it is the last stage's first rank.

Ranks are numbered stage-major, rank = pp_rank * tp + tp_rank (runtime.format.mapping.Mapping). Groups: one
per pipeline stage (its tp ranks' all_reduce and all_gather), the default group (send/recv between
stages, the logits to rank 0), and a gloo control group (the step broadcast).

Started locally by `engine-run` (launch.py: this process is rank 0 and starts the others with
`python -m runtime.ranks.launch`), or on every host by torchrun (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT from the environment). Before any rank computes, every rank opens the engine and rank 0
waits until all have (rendezvous.py): a missing rank file, another world size or another build is
one line naming the rank. A rank that dies or hangs later is named by the watchdog (watchdog.py).
"""

from runtime.format.engine_format import EngineError


class RankError(EngineError):
    """A rank died, hung or failed, so the engine cannot go on; LLMEngine.step re-raises it."""

    fatal = True
