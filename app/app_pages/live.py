"""Live: a run still being written redraws every few seconds; only the chart area reruns, so the
sidebar, the page and the chart's zoom (Plotly uirevision) stay where they are."""
from datetime import timedelta

import streamlit as st

import shared
from ampwatch import figures

path = shared.require_run()
if path is None:
    st.stop()
st.title("Live")
every = st.select_slider("Refresh every (s)", [1, 2, 3, 5, 10, 30], value=3, key="live_every")
follow = st.toggle("Refresh while the run is running", value=True, key="live_on")


def _draw() -> str:
    key = shared.stamp(path)
    row = shared.guarded(shared.run_row, str(path), key, path=path)
    if row is None:
        return "unreadable"
    cols = st.columns(4)
    cols[0].metric("status", row["status"])
    cols[1].metric("steps", f"{row['steps']:,}")
    cols[2].metric("skipped", f"{row['skipped']:,}")
    cols[3].metric("last loss", shared.fmt(row["last_loss"]))
    if not row["steps"]:
        st.info("No steps yet: waiting for the first flush.")
        return row["status"]
    ov = shared.guarded(shared.overview, str(path), key, path=path)
    if ov is not None:
        st.plotly_chart(figures.overview_figure(ov, log_loss=True), width="stretch", key="live_chart")
    return row["status"]


first = shared.guarded(shared.run_row, str(path), shared.stamp(path), path=path)
running = first is not None and first["status"] == "running"
if running and follow:
    st.caption(f"`{path.name}` is running: redrawing every {every} s.")
    st.fragment(run_every=timedelta(seconds=every))(_draw)()
else:
    if first is not None:
        st.caption(f"`{path.name}` is {first['status']}: nothing to follow, shown once.")
    _draw()
