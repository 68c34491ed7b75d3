"""What every page shares: the runs folder, the chosen run, the step range, and cached data access.

The runs folder is chosen in one place (:func:`default_folder`): AMPWATCH_RUNS if set, else
``sample_runs/`` under the working directory; the sidebar can change it. Run names from the sidebar
or the URL (``?run=name.sqlite``) are resolved inside that folder only (:func:`safe_run_path`).
Cached loaders are keyed on the file's (path, mtime, size) plus its WAL's, so a live run reloads.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Callable, Optional

import pandas as pd
import streamlit as st

from ampwatch.dashboard import rundata

from ampwatch.dashboard import ranks

from ampwatch.dashboard import layerdata
from ampwatch.errors import RunError
from ampwatch.store.reader import RUN_SUFFIXES

AUTO_DOCTOR_STEPS = 1_000_000  # ~5 s of doctor at 1M steps (bench/doctor.py); bigger runs ask first
SEVERITY_ICON = {"error": ":material/error:", "warning": ":material/warning:", "info": ":material/info:"}
SEVERITY_BADGE = {"error": ":red-badge[:material/error: ERROR]", "warning": ":orange-badge[:material/warning: WARNING]",
                  "info": ":blue-badge[:material/info: INFO]"}



# -- folder and run choice --------------------------------------------------------------------------

def default_folder() -> str:
    """The rule, in one place: $AMPWATCH_RUNS, else ./sample_runs (then the sidebar may override)."""
    return os.environ.get("AMPWATCH_RUNS") or "sample_runs"


def safe_run_path(folder: Any, name: Any) -> Optional[Path]:
    """``folder/name`` if it is a run file directly inside ``folder``; None for anything else
    (``../x``, absolute paths, symlinks out of the folder, sub-folders, other suffixes)."""
    if not name or not isinstance(name, str):
        return None
    root = Path(folder).resolve()
    candidate = (root / name).resolve()
    if not candidate.is_relative_to(root) or candidate.parent != root:
        return None
    if candidate.suffix not in RUN_SUFFIXES or not candidate.is_file():
        return None
    return candidate


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


def sidebar() -> tuple[Optional[Path], Optional[Path]]:
    """Render the folder and run pickers; returns (folder, run path) — either may be None.

    A run file typed as the folder opens its folder with that run chosen. A ``?run=`` name that is
    not in the folder chooses nothing (the page says so) and the URL keeps it. The default run is
    the first one that can be read."""
    st.sidebar.text_input("Runs folder", value=default_folder(), key="folder",
                          help="A folder of .sqlite run files. Default: $AMPWATCH_RUNS, else sample_runs/.",
                          on_change=_folder_changed)
    folder = Path(st.session_state["folder"]).expanduser()
    st.session_state["_missing"] = None
    wanted = st.query_params.get("run")
    if folder.is_file() and folder.suffix in RUN_SUFFIXES:
        st.sidebar.caption(f"`{folder.name}` is a run file: showing its folder.")
        if st.session_state.get("_file_folder") != str(folder):  # once per typed path, then the picker rules
            st.session_state["_file_folder"], st.session_state["run"] = str(folder), folder.name
        folder = folder.parent
    if not folder.is_dir():
        return None, None
    names = [f.name for f in sorted(folder.iterdir()) if safe_run_path(folder, f.name) is not None]
    if not names:
        return folder, None
    if st.session_state.get("run") not in names:
        if wanted and wanted not in names:
            st.session_state["_missing"] = wanted
            st.session_state["run"] = None
        else:
            st.session_state["run"] = wanted if wanted in names else _first_readable(folder, names)
    st.sidebar.selectbox("Run", names, key="run", on_change=_run_to_url, placeholder="Pick a run")
    path = safe_run_path(folder, st.session_state["run"])
    if path is not None and st.query_params.get("run") != path.name:
        st.query_params["run"] = path.name
    return folder, path


def _folder_changed() -> None:
    # A run named in the URL belongs to the old folder: the new one opens on its first readable run.
    st.query_params.pop("run", None)
    st.session_state["run"] = None


def _first_readable(folder: Path, names: list[str]) -> str:
    """The first run that opens (an unreadable first file must not be what a folder opens on)."""
    for name in names:
        path = folder / name
        try:
            run_row(str(path), stamp(path))
            return name
        except Exception:  # any unreadable file: try the next; the Runs page lists why
            continue
    return names[0]


def open_run(name: str) -> None:
    """Callback: make ``name`` (a file in the runs folder) the chosen run, as the sidebar would."""
    st.session_state["run"] = name
    st.query_params["run"] = name


def _run_to_url() -> None:
    if st.session_state["run"]:
        st.query_params["run"] = st.session_state["run"]


def require_run() -> Optional[Path]:
    """The chosen run's path, or a clear message in the page (and None)."""
    folder, path = st.session_state.get("_folder"), st.session_state.get("_run")
    if folder is None:
        typed = st.session_state.get("folder", default_folder())
        if Path(typed).expanduser().is_file():
            st.error(f"{typed!r} is a file, not a folder: type the folder that holds the .sqlite runs.")
        else:
            st.error(f"Runs folder {typed!r} does not exist. "
                     "Type an existing folder of .sqlite runs in the sidebar (or set AMPWATCH_RUNS).")
        return None
    missing = st.session_state.get("_missing")
    if path is None and missing:
        st.error(f"Run {missing!r} is not in {str(folder)!r}: pick a run in the sidebar.")
        return None
    if path is None:
        st.info(f"No runs in {str(folder)!r} yet. Record one with `ampwatch.attach(..., path='{folder}/x.sqlite')` "
                "or run `ampwatch demo`.")
        return None
    return path


def has_run_files(folder: Path) -> bool:
    """Any run file in ``folder``, readable or not (unreadable ones are listed on the Runs page)."""
    try:
        return any(f.suffix in RUN_SUFFIXES for f in folder.iterdir())
    except OSError:
        return False


def page_run() -> tuple[Path, tuple, dict]:
    """The chosen run's path, cache key and headline row; stops the page (after a message) without one."""
    path = require_run()
    if path is None:
        st.stop()
    key = stamp(path)
    row = guarded(run_row, str(path), key, path=path)
    if row is None:
        st.stop()
    return path, key, row


def page_runs() -> tuple[Path, pd.DataFrame, list]:
    """The runs folder, its runs table and its unreadable files; stops the page (after a message) without."""
    folder = st.session_state.get("_folder")
    if folder is None or not has_run_files(folder):  # the same message every page gives
        require_run()
        st.stop()
    table = guarded(runs_table, str(folder), folder_stamp(folder))
    if table is None:
        st.stop()
    runs, unreadable = table
    return folder, runs, unreadable


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


# -- step range (shared by the charts; findings and events jump it) ----------------------------------
# The truth lives in plain session keys ("_range:<file>", "_inspect"): Streamlit forgets a widget's
# state on a page that does not draw it, and the place must survive moving between pages.

def jump_to(path: Path, start: int, end: int, inspect: Optional[int] = None) -> None:
    """Callback: move the charts to [start, end] (and the step inspector to ``inspect``)."""
    st.session_state[f"_range:{path.name}"] = (int(start), int(end))
    if inspect is not None:
        st.session_state["_inspect"] = int(inspect)


def _keep(src: str, widget: str) -> None:
    st.session_state[src] = st.session_state[widget]


def followed_range(path: Path, first: int, last: int) -> tuple[int, int]:
    """The saved step range of this run, clamped to [first, last]: a range that ended at the run's
    last step follows a growing run's end; one the user narrowed stays (plain keys only, so a
    fragment may call it)."""
    src, seen = f"_range:{path.name}", f"_last:{path.name}"
    lo, hi = st.session_state.get(src, (first, last))
    if int(hi) >= int(st.session_state.get(seen, last)):
        hi = last
    st.session_state[seen] = last
    lo, hi = max(first, min(int(lo), last)), max(first, min(int(hi), last))
    st.session_state[src] = (min(lo, hi), max(lo, hi))
    return st.session_state[src]


def step_range(path: Path, first: int, last: int) -> tuple[int, int]:
    """The sidebar's step-range slider for this run (whole run by default); returns (start, end)."""
    if last <= first:
        return first, last
    src, widget = f"_range:{path.name}", f"range:{path.name}"
    st.session_state[widget] = followed_range(path, first, last)
    st.sidebar.slider("Steps", first, last, key=widget, on_change=_keep, args=(src, widget),
                      help="Zoom every chart to this step range (a range that ends at the last step follows a "
                           "growing run)")
    st.sidebar.button("Whole run", on_click=jump_to, args=(path, first, last), key=f"whole:{path.name}")
    return st.session_state[src]


def inspect_step(first: int, last: int, default: int) -> int:
    """The step inspector's step (kept across pages; events and findings set it)."""
    step = st.session_state.get("_inspect")
    if step is None or not first <= int(step) <= last:
        step = default
    st.session_state["_inspect"] = st.session_state["inspect_step"] = int(step)
    st.number_input("Step", min_value=first, max_value=last, step=1, key="inspect_step",
                    on_change=_keep, args=("_inspect", "inspect_step"))
    return int(st.session_state["_inspect"])


def fmt(x: Any, spec: str = "{:.4g}", nan: str = "NaN") -> str:
    """A number for display: NaN stays visibly 'NaN' (st.dataframe shows NaN as 'None'); None is '–'."""
    if x is None:
        return "–"
    if isinstance(x, float) and math.isnan(x):
        return nan
    return spec.format(x)


def readable(df: pd.DataFrame, columns: dict[str, str]) -> pd.DataFrame:
    """A copy for display with ``columns`` (name -> text for NaN) as text: NaN and 'not recorded' differ."""
    out = df.copy()
    for col, nan in columns.items():
        out[col] = [fmt(v, nan=nan) for v in out[col].astype(object)]
    return out


def download(df: pd.DataFrame, name: str, label: str = "Download CSV") -> None:
    st.download_button(label, df.to_csv(index=False).encode(), file_name=name, mime="text/csv",
                       key=f"dl:{name}")


# -- cached data (keyed on the file's stamp; returns pickled copies, never connections) --------------

@st.cache_data(show_spinner=False, max_entries=64)
def runs_table(folder: str, key: tuple) -> tuple[pd.DataFrame, list]:
    return rundata.runs_table(folder)


@st.cache_data(show_spinner="Reading steps...", max_entries=64)
def overview(path: str, key: tuple, start: Optional[int] = None, end: Optional[int] = None):
    return rundata.overview_data(path, start, end)


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
    from ampwatch.dashboard.fp8 import has_fp8_layers
    return has_fp8_layers(path)


@st.cache_data(show_spinner=False, max_entries=64)
def run_row(path: str, key: tuple) -> dict:
    return rundata.run_row(path)


@st.cache_data(show_spinner=False, max_entries=64)
def skip_rate(path: str, key: tuple) -> pd.DataFrame:
    return rundata.skip_rate(path)


@st.cache_data(show_spinner="Running the doctor...", max_entries=64)
def findings(path: str, key: tuple) -> list[dict]:
    """The doctor's findings as dicts; [] while ampwatch.doctor is not available."""
    import ampwatch
    try:
        found = ampwatch.diagnose(ampwatch.load(path))
    except (ImportError, AttributeError):
        return []
    return [f.to_dict() if hasattr(f, "to_dict") else dict(vars(f)) for f in found]


def doctor_findings(path: Path, key: tuple) -> list[dict]:
    """The doctor's findings when it has run or may run by itself (small runs); [] otherwise."""
    row = guarded(run_row, str(path), key, path=path)
    if row is None:
        return []
    if row["steps"] <= AUTO_DOCTOR_STEPS or st.session_state.get(f"doctor:{path.name}"):
        return guarded(findings, str(path), key, path=path) or []
    return []


def show_step(path: Path, key: tuple, step: int) -> None:
    """Every recorded figure at ``step``: the step row, events, layers, modules, metrics (sortable)."""
    detail = guarded(step_detail, str(path), key, step, path=path)
    if detail is None:
        return
    st.subheader(f"Step {step}")
    if detail["step"].empty:
        st.info(f"Step {step} was not recorded in this run.")
        return
    st.dataframe(detail["step"], hide_index=True, key="step_row")
    if len(detail["events"]):
        st.markdown("**NaN/Inf events** (origin first)")
        ev = detail["events"]
        nan_text = {"amax": "NaN", **({"fp32_amax": "–"} if "fp32_amax" in ev else {})}
        st.dataframe(readable(ev, nan_text), hide_index=True, key="step_events")
    if detail["layers"].empty:
        near = detail["layer_step_at_or_before"]
        st.info(f"No per-layer rows at step {step}: they are written every `layer_every` steps and on skipped "
                "or non-finite steps" + (f"; the nearest earlier one is step {near}." if near is not None else "."))
    else:
        st.markdown("**Per layer** (click a header to sort)")
        st.dataframe(detail["layers"], hide_index=True, key="step_layers")
        download(detail["layers"], f"{path.stem}_step{step}_layers.csv", "Download layers (CSV)")
    if len(detail["modules"]):
        st.markdown("**Per module** (max |value|; backward is the scaled gradient)")
        st.dataframe(detail["modules"], hide_index=True, key="step_modules")
    if len(detail["metrics"]):
        st.markdown("**Logged metrics**")
        st.dataframe(detail["metrics"], hide_index=True, key="step_metrics")
