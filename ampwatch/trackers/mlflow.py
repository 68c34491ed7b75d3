"""MLflow: metrics with their steps through ``MlflowClient.log_batch``; texts as run artifacts.

MLflow has no text-at-a-step: each finding or notice is an artifact
``amp/findings/step_<step>.md`` (``amp/notices/...``). The tracking URI is MLflow's own
(``MLFLOW_TRACKING_URI``); an exported run goes into ``MLFLOW_EXPERIMENT_NAME`` (else MLflow's
default experiment). The client is thread-safe and given the run id, so the writer thread can
log to a run the training thread started (MLflow's active run is per thread).
"""
from __future__ import annotations

import os
import re
import time
from typing import Any, Optional

from .series import Point

_BATCH = 1000  # MLflow's limit of metrics per log_batch
_PARAMS = 100  # and of params


def _key(tag: str) -> str:
    """A tag as an MLflow metric key (letters, digits, ``_ - . / `` and space only)."""
    return re.sub(r"[^\w\-./ ]", "_", tag)


class MlflowSink:
    """:param run_id: log into this run (live: the active run, left running on close); None:
    start a run of our own named ``run_name`` with ``config`` as params, ended on close."""

    def __init__(self, run_id: Optional[str] = None, *, run_name: Optional[str] = None,
                 config: Optional[dict] = None) -> None:
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient
        self._metric = Metric
        self._client = MlflowClient()
        self._own = run_id is None
        if run_id is None:
            experiment = self._experiment()
            run_id = self._client.create_run(experiment, run_name=run_name,
                                             tags={"ampwatch.exported": "true"}).info.run_id
            params = [Param(_key(str(k))[:250], str(v)[:500]) for k, v in (config or {}).items()]
            for i in range(0, len(params), _PARAMS):
                self._client.log_batch(run_id, params=params[i:i + _PARAMS])
        self.run_id = run_id
        self.where = f"MLflow run {run_id} at {self._client.tracking_uri}"

    def _experiment(self) -> str:
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if not name:
            return os.environ.get("MLFLOW_EXPERIMENT_ID") or "0"
        found = self._client.get_experiment_by_name(name)
        return found.experiment_id if found is not None else self._client.create_experiment(name)

    def scalars(self, points: list[Point]) -> None:
        Metric, batch = self._metric, []
        for p in points:
            ms = int((p.wall_time or time.time()) * 1000)
            batch.extend(Metric(_key(tag), value, ms, p.step) for tag, value in p.values.items())
            if len(batch) >= _BATCH:
                self._log(batch)
                batch = []
        if batch:
            self._log(batch)

    def _log(self, metrics: list) -> None:
        for i in range(0, len(metrics), _BATCH):
            self._client.log_batch(self.run_id, metrics=metrics[i:i + _BATCH], synchronous=True)

    def texts(self, tag: str, items: list[tuple[int, str]]) -> None:
        for step, text in items:
            self._client.log_text(self.run_id, text, f"{_key(tag)}/step_{step:09d}.md")

    def flush(self) -> None:
        pass  # every call above is synchronous

    def close(self) -> None:
        if self._own:
            self._client.set_terminated(self.run_id)
