"""What the pages share as state: the runs folder, the chosen run (and the URL's ``?run=``), the step range.

The runs folder is chosen in one place (:func:`default_folder`): AMPWATCH_RUNS if set, else
``sample_runs/`` under the working directory; the sidebar can change it. Run names from the sidebar
or the URL (``?run=name.sqlite``) are resolved inside that folder only (:func:`safe_run_path`).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import pandas as pd
import streamlit as st

import loaders
from loaders import RUN_SUFFIXES


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
            loaders.run_row(str(path), loaders.stamp(path))
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
    key = loaders.stamp(path)
    row = loaders.guarded(loaders.run_row, str(path), key, path=path)
    if row is None:
        st.stop()
    return path, key, row


def page_runs() -> tuple[Path, pd.DataFrame, list]:
    """The runs folder, its runs table (without health: ``loaders.runs_health``) and its unreadable
    files; stops the page (after a message) without."""
    folder = st.session_state.get("_folder")
    if folder is None or not has_run_files(folder):  # the same message every page gives
        require_run()
        st.stop()
    table = loaders.guarded(loaders.runs_table, str(folder))
    if table is None:
        st.stop()
    runs, unreadable = table
    return folder, runs, unreadable


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


def kept(key: str, default: Any) -> str:
    """``key`` for a widget whose value outlives pages that do not draw it: Streamlit forgets a
    widget's state once a run does not draw it, so the value also lives under a plain key and seeds
    the widget when its page is drawn again. Draw the widget without a default of its own."""
    src = f"_kept:{key}"
    if key not in st.session_state:
        st.session_state[key] = st.session_state.get(src, default)
    st.session_state[src] = st.session_state[key]
    return key


def inspect_step(first: int, last: int, default: int) -> int:
    """The step inspector's step (kept across pages; events and findings set it)."""
    step = st.session_state.get("_inspect")
    if step is None or not first <= int(step) <= last:
        step = default
    st.session_state["_inspect"] = st.session_state["inspect_step"] = int(step)
    st.number_input("Step", min_value=first, max_value=last, step=1, key="inspect_step",
                    on_change=_keep, args=("_inspect", "inspect_step"))
    return int(st.session_state["_inspect"])
