"""Runs: every run in the folder, filterable; pick one (or several to compare)."""
import streamlit as st

import formatting
import loaders
import state

st.title("Runs")
folder, runs, unreadable = state.page_runs()
st.caption(f"Folder: `{folder}`")
for name, reason in unreadable:
    st.warning(f"**{name}** cannot be read: {reason}")
if runs.empty:
    st.info("No readable runs here. Record one with `ampwatch.attach(...)` or run `ampwatch demo`.")
    st.stop()

# the doctor's verdicts: those not yet known are worked out in the background, the table drawn meanwhile
verdicts = loaders.runs_health(folder, runs["file"].tolist())
runs = runs.assign(health=[v if v is not None else "diagnosing..." for v in verdicts])
waiting = [f for f, v in zip(runs["file"], verdicts) if v is None]


@st.fragment(run_every=1.0 if waiting else None)
def _await_health() -> None:
    """While the doctor reads runs in the background: say which, and redraw the page when one is done."""
    left = [f for f, v in zip(waiting, loaders.runs_health(folder, waiting, start=False)) if v is None]
    if len(left) < len(waiting):
        st.rerun()  # the whole page: the table with the verdicts that came
    st.caption(f"The doctor is reading {len(left)} run{'s' if len(left) != 1 else ''} in the background "
               f"({', '.join(left)}): the health column fills in as it finishes; the table works meanwhile.")


query = st.text_input("Filter by name", key=state.kept("runs_filter", ""), placeholder="e.g. fp16")
shown = runs[runs["name"].str.contains(query, case=False, regex=False)] if query else runs
columns = ["name", "health", "status", "steps", "skipped_pct", "final_scale", "first_nonfinite_step", "last_loss",
           "started", "amp_dtype", "file"]


def _pick() -> None:
    rows = st.session_state["runs_table"].selection.rows
    files = shown["file"].iloc[rows].tolist()
    if files:
        st.session_state["run"] = files[0]
        st.query_params["run"] = files[0]
        st.session_state["compare"] = files


if waiting:
    _await_health()
formatting.table(formatting.runs_for_display(shown[columns]), key="runs_table",
                 on_select=_pick, selection_mode="multi-row", hide_index=True,
                 column_config=formatting.RUN_COLUMNS)
st.caption("Select rows to open a run (the first) or compare several; the sidebar shows the open run.")
picked = st.session_state.get("compare") or []
if picked:
    cols = st.columns(3)
    cols[0].page_link("app_pages/overview.py", label=f"Open {picked[0]}", icon=":material/show_chart:")
    if len(picked) > 1:
        cols[1].page_link("app_pages/compare.py", label=f"Compare {len(picked)} runs",
                          icon=":material/stacked_line_chart:")
formatting.download(shown[columns], "runs.csv")
