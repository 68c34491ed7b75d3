"""A saved run written into a tracker with its true step numbers (``ampwatch export --to``)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from ..errors import OutputError, RunError
from . import series


@dataclass
class Exported:
    """What one run sent: steps, scalar values and texts."""
    steps: int = 0
    scalars: int = 0
    texts: int = 0


def export_run(run: Any, sink: Any) -> Exported:
    """Every step, per-layer norm, headroom, notice and doctor finding of ``run`` (an
    :class:`ampwatch.Run`) into ``sink``, which is closed afterwards, also on failure."""
    from ..doctor import diagnose
    from ..store.reader import connect
    done = Exported()
    try:
        with connect(run.path) as conn:
            for points in series.read_points(conn):
                sink.scalars(points)
                done.steps += len(points)
                done.scalars += sum(len(p.values) for p in points)
            notices = conn.execute("SELECT step, code, message FROM notices ORDER BY step").fetchall()
        texts = [(series.NOTICES, series.notice_texts(notices)),
                 (series.FINDINGS, series.finding_texts(diagnose(run)))]
        for tag, items in texts:
            if items:
                sink.texts(tag, items)
                done.texts += len(items)
    finally:
        sink.close()
    return done


def export_paths(path: str, to: str, out: Optional[str], make_folder: Callable[[str], Path]
                 ) -> Iterator[tuple[bool, str]]:
    """``ampwatch export PATH --to TRACKER``: a run file, or every run of a folder (the ranks of a
    job as ``<job>/rank<N>``). Yields ``(ok, line)`` per run written or file that could not be read.

    Raises :class:`ampwatch.errors.RunError` / :class:`ampwatch.errors.OutputError` (one line) for a
    bad PATH or --out, before anything is written, and ``TrackerUnavailable`` (as a RunError line
    by the CLI) for a tracker that is not installed."""
    from . import TrackerUnavailable, export_sink
    from ..store.reader import Run
    if to == "tensorboard" and out is None:
        raise OutputError("--to tensorboard needs --out LOGDIR: the log folder to write into")
    if to != "tensorboard" and out is not None:
        raise OutputError(f"--out is for files and TensorBoard; --to {to} writes where {_WHERE[to]} says: "
                          f"leave --out out")
    runs, problems = _runs_of(Path(path))
    for p in problems:
        yield False, p
    if not runs:
        return
    logdir = make_folder(out) if out is not None else None
    if logdir is not None:
        for label, _ in runs:
            if (logdir / label).exists() and any((logdir / label).glob("events.out.tfevents.*")):
                raise OutputError(f"{str(logdir / label)!r} already holds TensorBoard events (an earlier "
                                  f"export?): pass another --out, or remove that folder")
    for label, run_path in runs:
        try:
            run = Run(run_path)
            sink = export_sink(to, logdir=str(logdir / label) if logdir else None, name=label,
                               config=run.info.get("config"))
        except TrackerUnavailable as exc:
            raise OutputError(str(exc)) from None
        except RunError as exc:
            yield False, str(exc)
            continue
        done = export_run(run, sink)
        where = str(logdir / label) if logdir else sink.where
        yield True, f"wrote {label} to {where} ({done.steps} steps, {done.scalars} values, {done.texts} texts)"


_WHERE = {"mlflow": "MLFLOW_TRACKING_URI", "wandb": "W&B's environment (WANDB_PROJECT, WANDB_MODE)"}


def _label(name: str) -> str:
    """A run's name as one safe folder name (no '/', '..' or control bytes)."""
    return re.sub(r"[^\w.-]", "_", name).lstrip(".") or "run"


def _runs_of(path: Path) -> tuple[list[tuple[str, Path]], list[str]]:
    """``[(label, file)]`` to export and the reasons files of a folder cannot be; a single file is
    its own label (its run's name)."""
    from ..store.reader import Run
    if not path.is_dir():
        return [(_label(Run(path).name), path)], []
    from ..jobs.group import load_groups
    runs, problems = [], []
    for group in load_groups(path):
        problems.extend(u.reason for u in group.unreadable)
        job = group.world_size > 1 or len(group.paths) > 1
        for rank, file in group.paths.items():
            label = f"{_label(group.name)}/rank{rank}" if job else _label(Run(file).name)
            runs.append((label, file))
    taken: dict[str, int] = {}
    for i, (label, file) in enumerate(runs):  # two runs of one name (renamed copies): keep both
        taken[label] = taken.get(label, 0) + 1
        if taken[label] > 1:
            runs[i] = (f"{label}_{taken[label]}", file)
    return runs, problems
