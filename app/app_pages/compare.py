"""Compare: two or more runs overlaid on one step axis (loss, scale, grad norm, skip rate); for
two runs, where they part first (step, layer, module) and which settings differ."""
import pandas as pd
import streamlit as st

import formatting
import headlines
import loaders
import state
from ampwatch.dashboard import figures

st.title("Compare runs")
if st.session_state.get("_run") is None:  # no folder, or a folder without runs: say which
    state.require_run()
    st.stop()
folder, runs, unreadable = state.page_runs()
files = runs["file"].tolist() if len(runs) else []
if len(files) < 2:
    st.info("Compare needs at least two readable runs in the folder.")
    st.stop()
wanted = [f for f in st.session_state.get("compare") or [] if f in files]  # rows selected on the Runs page
if len(wanted) < 2:  # else the open run, then the folder's next ones
    current = st.session_state["_run"].name
    wanted = ([current] if current in files else []) + [f for f in files if f != current]
    wanted = wanted[:4]
kept = st.session_state.get("_kept:compare_pick") or []
if st.session_state.get("_compare_from") != wanted or not set(kept) <= set(files):
    # a new selection on the Runs page (or another open run) starts over; else the picks stay
    st.session_state["_compare_from"] = wanted
    st.session_state.pop("_kept:compare_pick", None)
    st.session_state.pop("compare_pick", None)
picked = st.multiselect("Runs", files, key=state.kept("compare_pick", wanted))
if len(picked) < 2:
    st.info("Pick at least two runs.")
    st.stop()

overviews, rates, rows = {}, {}, []
for name in picked:
    path = state.safe_run_path(folder, name)
    if path is None:
        continue
    key = loaders.stamp(path)
    ov = loaders.guarded(loaders.overview, str(path), key, path=path)
    rate = loaders.guarded(loaders.skip_rate, str(path), key, path=path)
    if ov is None or rate is None:
        continue
    label = name.rsplit(".", 1)[0]
    overviews[label], rates[label] = ov, rate
    rows.append(ov.steps.assign(run=label))
if not overviews:
    st.stop()
# where two runs part goes first on the page but is worked out last: on two long runs it takes
# seconds (39 s at 1M steps, docs/performance.md), and the charts need not wait for it
diff_box = st.container()
log_loss = st.toggle("log loss axis", key=state.kept("compare_log", True))
st.plotly_chart(figures.compare_figure(overviews, rates, log_loss=log_loss), width="stretch",
                key="compare_chart")
summary = runs[runs["file"].isin(picked)][["name", "status", "steps", "skipped", "skipped_pct", "final_scale",
                                           "first_nonfinite_step", "last_loss"]]
formatting.table(formatting.runs_for_display(summary), hide_index=True,
                 key="compare_table", column_config=formatting.RUN_COLUMNS)
formatting.download(pd.concat(rows, ignore_index=True), "compare_steps.csv", "Download shown steps (CSV)")
if len(picked) == 2:
    paths = [state.safe_run_path(folder, name) for name in picked]
    if None not in paths:
        with diff_box:
            found = loaders.guarded(loaders.run_diff, str(paths[0]), loaders.stamp(paths[0]),
                                    str(paths[1]), loaders.stamp(paths[1]), path=paths[0])
            if found is not None:
                kind, text = headlines.diff_headline(found)
                getattr(st, kind)(text)
