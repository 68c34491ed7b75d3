"""Compare: two or more runs overlaid on one step axis (loss, scale, grad norm, skip rate)."""
import pandas as pd
import streamlit as st

import shared
from ampwatch.dashboard import figures

st.title("Compare runs")
if st.session_state.get("_run") is None:  # no folder, or a folder without runs: say which
    shared.require_run()
    st.stop()
folder, runs, unreadable = shared.page_runs()
files = runs["file"].tolist() if len(runs) else []
if len(files) < 2:
    st.info("Compare needs at least two readable runs in the folder.")
    st.stop()
wanted = [f for f in st.session_state.get("compare") or [] if f in files]
if len(wanted) < 2:
    wanted = files[: min(4, len(files))]
if "compare_pick" not in st.session_state or not set(st.session_state["compare_pick"]) <= set(files):
    st.session_state["compare_pick"] = wanted
picked = st.multiselect("Runs", files, key="compare_pick")
if len(picked) < 2:
    st.info("Pick at least two runs.")
    st.stop()

overviews, rates, rows = {}, {}, []
for name in picked:
    path = shared.safe_run_path(folder, name)
    if path is None:
        continue
    key = shared.stamp(path)
    ov = shared.guarded(shared.overview, str(path), key, path=path)
    rate = shared.guarded(shared.skip_rate, str(path), key, path=path)
    if ov is None or rate is None:
        continue
    label = name.rsplit(".", 1)[0]
    overviews[label], rates[label] = ov, rate
    rows.append(ov.steps.assign(run=label))
if not overviews:
    st.stop()
log_loss = st.toggle("log loss axis", value=True, key="compare_log")
st.plotly_chart(figures.compare_figure(overviews, rates, log_loss=log_loss), width="stretch",
                key="compare_chart")
summary = runs[runs["file"].isin(picked)][["name", "status", "steps", "skipped", "skipped_pct", "final_scale",
                                           "first_nonfinite_step", "last_loss"]]
st.dataframe(shared.readable(summary, {"final_scale": "–", "last_loss": "NaN"}), hide_index=True, key="compare_table",
             column_config={"skipped_pct": st.column_config.NumberColumn("skipped %", format="%.1f")})
shared.download(pd.concat(rows, ignore_index=True), "compare_steps.csv", "Download shown steps (CSV)")
