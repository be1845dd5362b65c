"""What a pass may read besides the graph: the plan, the model source and the build options."""

from __future__ import annotations

from dataclasses import dataclass, field

from builder.sources.model import ModelSpec
from builder.planning.plan import Plan


@dataclass(frozen=True)
class PassContext:
    plan: Plan
    model: ModelSpec | None = None  # raw quantized blocks, calibration (None: a pass test's bare graph)
    rank: int = 0
    debug: bool = False
    calibration_text: str | None = None
    evaluation_text: str | None = None
    report: dict = field(default_factory=dict)  # figures passes record for the manifest and report
    show_progress: bool = False  # passes with long loops show a progress bar
    only_rank: int | None = None  # a build of one rank (--rank): the per-rank passes run for it alone
