"""Live: a run still being written redraws every few seconds; only the chart area reruns, so the
sidebar and the page stay where they are. A drag across the chart becomes the sidebar's Steps range
(ending at the last step, it follows the run; narrowed, it stays), the view that survives a redraw:
Streamlit mounts a chart whose data changed as a new element, so Plotly's uirevision keeps its own
zoom only while no new steps arrive."""
import math
import time
from datetime import timedelta

import streamlit as st

import formatting
import loaders
import state
from ampwatch.dashboard import figures

path = state.require_run()
if path is None:
    st.stop()
st.title("Live")
every = st.select_slider("Refresh every (s)", [1, 2, 3, 5, 10, 30], key=state.kept("live_every", 3))
follow = st.toggle("Refresh while the run is running", key=state.kept("live_on", True))


def _row(key: tuple):
    # A writer killed without a word leaves the file unchanged but its status ages ('interrupted' after
    # a silent heartbeat): the cached row also expires every 10 s.
    return loaders.guarded(loaders.run_row, str(path), key + (int(time.time()) // 10,), path=path)


def _zoom() -> None:
    """A box dragged on the chart becomes the Steps range: a server-side zoom that redraws keep."""
    boxes = st.session_state["live_chart"].selection.get("box") or []
    xs = [float(x) for b in boxes[:1] for x in b.get("x", [])]
    if len(xs) >= 2:
        state.jump_to(path, math.floor(min(xs)), math.ceil(max(xs)))
        st.session_state["_live_zoomed"] = True  # the sidebar slider is outside the fragment: redraw it too


def _draw(following: bool = False) -> str:
    if st.session_state.pop("_live_zoomed", False):
        st.rerun()
    key = loaders.stamp(path)
    row = _row(key)
    if row is None:
        return "unreadable"
    if following and row["status"] != "running":
        st.rerun()  # the run ended: redraw the whole page once, without the timer
    if following:
        st.caption(f"`{path.name}` is running: redrawing every {every} s.")
    cols = st.columns(4)
    cols[0].metric("status", row["status"])
    cols[1].metric("steps", f"{row['steps']:,}")
    cols[2].metric("skipped", f"{row['skipped']:,}")
    cols[3].metric("last loss", formatting.fmt(row["last_loss"]))
    if not row["steps"]:
        st.info("No steps yet: waiting for the first flush.")
        return row["status"]
    # The Steps range (sidebar) is the view that survives redraws: Streamlit draws a chart whose data
    # changed as a new element, so a mouse zoom lasts only until the next new steps arrive.
    start, end = state.followed_range(path, int(row["first_step"]), int(row["last_step"]))
    drawn_last, drawn_at = st.session_state.get(f"_live_drawn:{path.name}", (None, 0.0))
    if following and end == row["last_step"] and drawn_last is not None and end > drawn_last \
            and time.time() - drawn_at >= max(10, every):
        st.rerun()  # the sidebar's Steps slider (outside this fragment) still ends at drawn_last: catch it up
    ov = loaders.guarded(loaders.overview, str(path), key, start, end, path=path)
    if ov is not None:  # one uirevision per run: a redraw without new steps keeps the user's zoom
        fig = figures.overview_figure(ov, log_loss=True, uirevision=f"live:{path.name}")
        fig.update_layout(dragmode="select", selectdirection="h")  # a drag picks the steps to keep in view
        st.plotly_chart(fig, width="stretch", key="live_chart", on_select=_zoom, selection_mode="box")
        st.caption("Drag across the chart to zoom to those steps (kept across redraws); *Whole run* in the "
                   "sidebar zooms out.")
        memory = loaders.guarded(loaders.memory, str(path), key, ov.first, ov.last, path=path)
        if memory is not None and len(memory):  # a leak shows here while the run can still be saved
            mem = figures.memory_figure(memory, (ov.first, ov.last), height=240)
            mem.update_layout(uirevision=f"live-memory:{path.name}", title={"text": "memory"})
            st.plotly_chart(mem, width="stretch", key="live_memory")
    return row["status"]


first = _row(loaders.stamp(path))
if first is not None and first["steps"]:
    state.step_range(path, int(first["first_step"]), int(first["last_step"]))
    st.session_state[f"_live_drawn:{path.name}"] = (int(first["last_step"]), time.time())
running = first is not None and first["status"] == "running"
if running and follow:
    st.fragment(run_every=timedelta(seconds=every))(_draw)(following=True)
else:
    if first is not None:
        ended = {"finished": "ended (finished)", "crashed": "ended: it crashed",
                 "interrupted": "ended: its writer stopped without closing the file (interrupted)"}
        why = ended.get(first["status"], first["status"])
        st.caption(f"`{path.name}` {why}: nothing to follow, shown once." if not running
                   else f"`{path.name}` is running; following is off: shown once.")
    _draw()
