"""Weights & Biases: one history row per optimizer step, against an ``amp/step`` axis.

W&B's own step must only grow and belongs to the user's ``wandb.log`` calls, so the AMP series
carry the optimizer step as ``amp/step`` and are declared against it (``define_metric``): the
charts show true step numbers whatever the user logs. Texts (findings, notices) are a table
logged when they are sent. W&B's own environment applies (``WANDB_PROJECT``, ``WANDB_MODE=offline``).
"""
from __future__ import annotations

import os
from typing import Any, Optional

from .series import PREFIX, Point

STEP = PREFIX + "step"


class WandbSink:
    """:param run: log into this run (live: ``wandb.run``, left running on close); None: start a
    run of our own (``name``, ``config``) in ``WANDB_PROJECT`` (default ``ampwatch``), finished on close."""

    def __init__(self, run: Any = None, *, name: Optional[str] = None, config: Optional[dict] = None) -> None:
        import wandb
        self._wandb = wandb
        self._own = run is None
        if run is None:
            run = wandb.init(project=os.environ.get("WANDB_PROJECT", "ampwatch"), name=name, config=config or {},
                             reinit="create_new")
        self._run = run
        run.define_metric(STEP, hidden=True)
        run.define_metric(PREFIX + "*", step_metric=STEP)
        self.where = f"W&B run {run.id} ({getattr(run, 'dir', '') or ''})"

    def scalars(self, points: list[Point]) -> None:
        for p in points:
            self._run.log({STEP: p.step, **p.values})

    def texts(self, tag: str, items: list[tuple[int, str]]) -> None:
        table = self._wandb.Table(columns=["step", "text"], data=[[s, t] for s, t in items])
        self._run.log({tag: table})

    def flush(self) -> None:
        pass  # the W&B service process does its own buffering

    def close(self) -> None:
        if self._own:
            self._run.finish()
