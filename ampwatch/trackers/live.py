"""Live mirroring: what the writer thread commits, sent on to a tracker from that same thread.

The training thread does nothing for it: :class:`Mirror` is the run writer's ``on_commit``, so it
sees each batch of rows once they are in the run file and turns them into tracker calls there.
A tracker that fails (not installed, no active run, closed, raising mid-run) warns once and is
dropped; recording and training go on.
"""
from __future__ import annotations

import logging
import time
import warnings
from typing import Any, Callable, Optional

from . import series

log = logging.getLogger("ampwatch")

# The doctor reads the whole run file, on the writer thread, where its GIL time is taken from
# training: at most this often, and never more than ~1% of the time (see _Findings.due).
FINDINGS_EVERY_S = 60.0
FINDINGS_DUTY = 0.01


class Mirror:
    """The writer's ``on_commit``: rows -> tracker.

    :param sink: a tracker sink (:mod:`.tensorboard`, :mod:`.mlflow`, :mod:`.wandb`).
    :param builder: turns rows into points (the run's names and autocast dtype).
    :param run_path: the run file, read by the doctor for findings.
    :param label: how warnings name the tracker.
    """

    def __init__(self, sink: Any, builder: series.SeriesBuilder, run_path: str, label: str) -> None:
        self.sink: Optional[Any] = sink
        self.builder = builder
        self.label = label
        self.failure: Optional[BaseException] = None
        self._findings = _Findings(run_path)

    def __call__(self, rows: Any, info: dict, notices: list) -> None:
        if self.sink is None:
            return
        try:
            self._send(rows, info, notices)
        except Exception as exc:
            self._drop(exc)

    def _send(self, rows: Any, info: dict, notices: list) -> None:
        if info.get("amp_dtype"):
            self.builder.amp_dtype = info["amp_dtype"]
        points = self.builder.points(rows.steps, rows.layers, rows.modules, rows.memory)
        if points:
            self.sink.scalars(points)
        if notices:
            self.sink.texts(series.NOTICES, series.notice_texts(notices))
        final = "status" in info  # close() puts the final status: the last commit
        new = self._findings.new(final)
        if new:
            self.sink.texts(series.FINDINGS, series.finding_texts(new))
        if final:
            sink, self.sink = self.sink, None
            sink.close()
        else:
            self.sink.flush()

    def _drop(self, exc: BaseException) -> None:
        self.failure = exc
        sink, self.sink = self.sink, None
        warnings.warn(f"ampwatch stopped mirroring to {self.label}: {type(exc).__name__}: {exc}. "
                      f"Recording and training continue.", RuntimeWarning, stacklevel=2)
        try:
            sink.close()
        except Exception:  # a tracker that failed may fail again on close: it is dropped either way
            pass


class _Findings:
    """The doctor's findings that the tracker has not been sent yet."""

    def __init__(self, run_path: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.run_path = run_path
        self._clock = clock
        self._sent: set[tuple[str, int]] = set()
        self._next = clock() + FINDINGS_EVERY_S
        self._broken = False

    def new(self, final: bool) -> list:
        if self._broken or (not final and self._clock() < self._next):
            return []
        from ..doctor import diagnose
        from ..store.reader import Run
        started = self._clock()
        try:
            findings = diagnose(Run(self.run_path))
        except Exception as exc:  # the series still go out; the findings stay in the run file
            self._broken = True
            log.warning("findings are not mirrored (the doctor failed on %s: %s: %s)",
                        self.run_path, type(exc).__name__, exc)
            return []
        took = self._clock() - started
        self._next = self._clock() + max(FINDINGS_EVERY_S, took / FINDINGS_DUTY)
        fresh = [f for f in findings if (f.id, int(f.steps[0])) not in self._sent]
        self._sent.update((f.id, int(f.steps[0])) for f in fresh)
        return fresh


def open_mirror(target: Any, param_names: list[str], module_ids: list[int], module_types: list[str],
                run_path: str) -> Optional[Mirror]:
    """The mirror for ``attach(mirror=target)``, or None (with one warning) when the tracker cannot
    be used: recording goes on without it. Runs on the training thread, once, at attach."""
    from . import TrackerUnavailable, mirror_sink
    try:
        sink, label = mirror_sink(target)
    except TrackerUnavailable as exc:
        warnings.warn(f"ampwatch is not mirroring: {exc}. Recording and training continue.",
                      RuntimeWarning, stacklevel=4)
        return None
    except Exception as exc:  # whatever a tracker library raises at setup
        warnings.warn(f"ampwatch is not mirroring to {target!r}: {type(exc).__name__}: {exc}. "
                      f"Recording and training continue.", RuntimeWarning, stacklevel=4)
        return None
    from .. import doctor  # noqa: F401  (imported here, not first on the writer thread mid-run)
    builder = series.SeriesBuilder(dict(enumerate(param_names)), dict(zip(module_ids, module_types)))
    return Mirror(sink, builder, run_path, label)
