"""Cached data for the pages: thin ``@st.cache_data`` wrappers of the library's readers.

Every loader is keyed on the file's stamp (:func:`stamp`: (mtime, size) of the file and of its WAL),
so a live run reloads; they return pickled copies (rows, DataFrames), never connections.
:func:`guarded` calls one and turns a file that cannot be read into one line in the page.
The app reads the library through this module only (pages import ``ampwatch.dashboard.figures`` for drawing).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Optional

import pandas as pd
import streamlit as st

import ampwatch
from ampwatch.dashboard import fp8, layerdata, ranks, rundata
from ampwatch.dashboard.fp8 import FP8_METRICS  # noqa: F401 - for the FP8 page
from ampwatch.dashboard.layerdata import LAYER_METRICS, grid_frame  # noqa: F401 - for the Layers page
from ampwatch.doctor import health as doctor_health
from ampwatch.doctor.finding import Finding
from ampwatch.errors import RunError
from ampwatch.store.reader import RUN_SUFFIXES

import diagnoses

AUTO_DOCTOR_STEPS = 1_000_000  # ~7 s of doctor at 1M steps on 2 cores (bench/doctor.py); bigger runs ask first
# runs not yet diagnosed that hold fewer steps than this (all together: ~0.4 s of doctor) are read
# before the runs table is drawn, for up to INLINE_DOCTOR_S (a folder of many short runs: ~0.15 s of
# doctor each); past either the table comes first and their health fills in
INLINE_DOCTOR_STEPS = 50_000
INLINE_DOCTOR_S = 2.0


def stamp(path: Path) -> tuple:
    """(mtime, size) of the file and of its WAL: a live run's new rows land in the WAL first."""
    out: list = []
    for p in (path, Path(f"{path}-wal")):
        try:
            st_ = p.stat()
            out += [st_.st_mtime_ns, st_.st_size]
        except OSError:
            out += [0, 0]
    return tuple(out)


def folder_stamp(folder: Path) -> tuple:
    try:
        return tuple(sorted((f.name,) + stamp(f) for f in folder.iterdir() if f.suffix in RUN_SUFFIXES))
    except OSError:
        return ()


def report(exc: Exception, path: Optional[Path] = None) -> None:
    """One clear line for a run that cannot be shown (never a traceback)."""
    where = f" ({path.name})" if path is not None else ""
    st.error(f"Cannot show this run{where}: {exc}")


def guarded(fn: Callable, *args: Any, path: Optional[Path] = None, **kwargs: Any) -> Any:
    """Call a loader; on a bad file show one line and return None."""
    try:
        return fn(*args, **kwargs)
    except RunError as exc:
        report(exc, path)
    except Exception as exc:  # corrupt files surface as many sqlite/pandas errors: still one line
        report(RunError(f"{type(exc).__name__}: {exc}"), path)
    return None


def runs_table(folder: str) -> tuple[pd.DataFrame, list]:
    """The folder's runs table without health (:func:`runs_health`) and its unreadable files, each
    row read once per version of its file: a live run growing beside them rereads only itself."""
    rows, bad = [], []
    for f, refused in rundata.run_files(folder):
        if refused is not None:
            bad.append((f.name, refused))
            continue
        try:
            rows.append(run_row(str(f), stamp(f)))
        except RunError as exc:
            bad.append((f.name, str(exc)))
    return rundata.runs_frame(rows), bad


@st.cache_data(show_spinner="Reading steps...", max_entries=64)
def overview(path: str, key: tuple, start: Optional[int] = None, end: Optional[int] = None):
    return rundata.overview_data(path, start, end)


@st.cache_data(show_spinner=False, max_entries=64)
def memory(path: str, key: tuple, start: Optional[int] = None, end: Optional[int] = None) -> pd.DataFrame:
    return rundata.memory_data(path, start, end)


@st.cache_data(show_spinner="Reading layers...", max_entries=32)
def heatmap(path: str, key: tuple, metric: str, start: Optional[int], end: Optional[int]):
    return layerdata.layer_heatmap(path, metric, start, end)


@st.cache_data(show_spinner="Reading modules...", max_entries=32)
def headroom(path: str, key: tuple, start: Optional[int], end: Optional[int]) -> pd.DataFrame:
    return layerdata.module_headroom(path, start, end)


@st.cache_data(show_spinner=False, max_entries=32)
def zero_grads(path: str, key: tuple, start: Optional[int], end: Optional[int]) -> pd.DataFrame:
    return layerdata.zero_grad_fraction(path, start, end)


@st.cache_data(show_spinner=False, max_entries=64)
def events(path: str, key: tuple) -> pd.DataFrame:
    return rundata.events(path)


@st.cache_data(show_spinner=False, max_entries=256)
def step_detail(path: str, key: tuple, step: int) -> dict:
    return rundata.step_detail(path, step)


@st.cache_data(show_spinner=False, max_entries=16)
def input_arrays(path: str, key: tuple, step: int) -> bytes:
    """The saved inputs of ``step`` as one .npz file's bytes (every micro-batch saved; a dtype numpy lacks
    as its raw bits): what the step inspector's download button hands over."""
    return rundata.input_arrays(path, step)


@st.cache_data(show_spinner="Reading the job's ranks...", max_entries=16)
def job_view(folder: str, key: tuple, file: str) -> ranks.JobView:
    """The job ``file`` belongs to (keyed on the whole folder's stamp: any rank may grow)."""
    return ranks.job_view(folder, file)


def has_fp8(path: Optional[Path]) -> bool:
    """Whether the chosen run recorded fp8 layers (an unreadable file: no; its page says why)."""
    if path is None:
        return False
    try:
        return _has_fp8(str(path), stamp(path))
    except Exception:
        return False


@st.cache_data(show_spinner=False, max_entries=64)
def _has_fp8(path: str, key: tuple) -> bool:
    return fp8.has_fp8_layers(path)


@st.cache_data(show_spinner="Reading fp8 layers...", max_entries=32)
def fp8_grid(path: str, key: tuple, metric: str, start: int, end: int):
    return fp8.fp8_grid(path, metric, start, end)


@st.cache_data(show_spinner=False, max_entries=32)
def fp8_summary(path: str, key: tuple) -> pd.DataFrame:
    return fp8.fp8_summary(path)


@st.cache_data(show_spinner=False, max_entries=256)
def run_row(path: str, key: tuple) -> dict:
    return rundata.run_row(path)


@st.cache_data(show_spinner=False, max_entries=64)
def detail_cost(path: str, key: tuple) -> Optional[str]:
    return rundata.detail_cost_text(path)


@st.cache_data(show_spinner=False, max_entries=64)
def skip_rate(path: str, key: tuple) -> pd.DataFrame:
    return rundata.skip_rate(path)


def _diagnose(path: str) -> list[dict]:
    return [f.to_dict() for f in ampwatch.diagnose(ampwatch.load(path))]


def findings(path: str, key: tuple) -> list[dict]:
    """The doctor's findings as dicts, once per version of the file (the Runs page may have worked
    them out already, or be working on them: :mod:`diagnoses`)."""
    done = diagnoses.finished(path, key)
    if done is not None:  # known already: no spinner flashing on every redraw
        return done.result()
    with st.spinner("Running the doctor..."):
        return diagnoses.result(path, key, _diagnose)


def health(found: list[dict]) -> str:
    """The runs table's verdict from :func:`findings` (:func:`ampwatch.doctor.health`)."""
    return doctor_health([Finding.from_dict(f) for f in found])


def runs_health(folder: Path, files: list[str], start: bool = True) -> list[Optional[str]]:
    """Each run's health: the doctor's verdict on the file as it is, else its latest verdict on an
    earlier version (a live run's, a flush behind), else None while the doctor has yet to read it.
    With ``start``, files without a verdict on their current version are handed to the background
    doctor (:mod:`diagnoses`), except while together they stay under INLINE_DOCTOR_STEPS and
    INLINE_DOCTOR_S: those are read now, so a folder of a few short runs shows whole at once. A run
    past AUTO_DOCTOR_STEPS is read only on request, as on its overview. A run the doctor cannot
    read says so in its health, as the library's runs table does."""
    out: list[Optional[str]] = []
    budget, until = INLINE_DOCTOR_STEPS, time.monotonic() + INLINE_DOCTOR_S
    for name in files:
        path = folder / name
        key = stamp(path)
        try:
            exact = diagnoses.finished(str(path), key)
            done = exact or diagnoses.latest(str(path))
            if exact is None:
                steps = run_row(str(path), key)["steps"]
                if steps > AUTO_DOCTOR_STEPS:
                    if done is None:
                        out.append(f"not diagnosed: {steps:,} steps (its overview runs the doctor on request)")
                        continue
                elif start and steps <= budget and time.monotonic() < until:
                    budget -= steps
                    diagnoses.result(str(path), key, _diagnose)
                    done = diagnoses.finished(str(path), key)
                elif start:
                    diagnoses.start(str(path), key, _diagnose)
            out.append(None if done is None else health(done.result()))
        except Exception as exc:  # one line, as rundata.run_health says it
            out.append(f"unreadable: {exc}")
    return out


def doctor_findings(path: Path, key: tuple) -> list[dict]:
    """The doctor's findings when it has run or may run by itself (small runs); [] otherwise."""
    row = guarded(run_row, str(path), key, path=path)
    if row is None:
        return []
    if row["steps"] <= AUTO_DOCTOR_STEPS or st.session_state.get(f"doctor:{path.name}"):
        return guarded(findings, str(path), key, path=path) or []
    return []


@st.cache_data(show_spinner="Comparing the two runs...", max_entries=32)
def run_diff(path_a: str, key_a: tuple, path_b: str, key_b: tuple) -> dict:
    """Where two runs part (:func:`ampwatch.doctor.diff.diff_runs`), as plain data."""
    from ampwatch.doctor.diff import diff_runs
    return diff_runs(path_a, path_b).to_dict()
