"""Run overview: the doctor's findings, headline figures, then loss/scale/grad norm/lr on one step axis."""
import streamlit as st

import formatting
import headlines
import loaders
import state
from ampwatch.dashboard import figures

path, key, row = state.page_run()
st.title(f"{row['name']}")
st.caption(f"`{path.name}` · {row['status']} · {row['amp_dtype'] or 'no autocast dtype recorded'}")
if not row["steps"]:
    st.info("This run has no steps yet: nothing to draw. A live run shows steps after its first flush (~1 s).")
    st.stop()

# The page reads top to bottom: the doctor's findings, the headline figures, the charts. The doctor
# runs last, into boxes kept at the top: on a long run it reads whole tables (about 7 s on 1M steps
# with 200 layers, 2 cores) while the charts take about 1 s, and they need not wait for it. Past a
# million steps it waits for a click, so a rerun does not restart it.
findings_box = st.container()
m = st.columns(5)  # the headline figures; the fourth is the doctor's, filled once it has run
m[0].metric("steps", f"{row['steps']:,}",
            help=f"steps {row['first_step']:,}–{row['last_step']:,}: numbered on from a checkpoint (first_step)"
            if row["first_step"] else None)
m[1].metric(f"skipped ({row['skipped_pct']:.1f}%)", f"{row['skipped']:,}")  # short values: they must fit
m[2].metric("final loss scale", formatting.fmt_scale(row["final_scale"]))
m[4].metric("last loss", formatting.fmt(row["last_loss"]))
cost = loaders.guarded(loaders.detail_cost, str(path), key, path=path)
if cost:  # what the recording's detail steps cost this run, from its own step times
    st.caption(f"ampwatch: {cost}")
notice_box = st.container()

start, end = state.step_range(path, row["first_step"], row["last_step"])
ov = loaders.guarded(loaders.overview, str(path), key, start, end, path=path)
if ov is not None:
    log_loss = st.toggle("log loss axis", key=state.kept("log_loss", True))
    st.plotly_chart(figures.overview_figure(ov, log_loss=log_loss), width="stretch", key="overview_chart")
    drawn = "every step" if ov.bucket == 1 else f"min/max per {ov.bucket:,} steps + every skip and NaN"
    st.caption(f"Steps {ov.first:,}–{ov.last:,}, {len(ov.steps):,} points drawn ({drawn}).")
    formatting.download(ov.steps, f"{path.stem}_steps_{ov.first}-{ov.last}.csv", "Download shown steps (CSV)")

    memory = loaders.guarded(loaders.memory, str(path), key, ov.first, ov.last, path=path)
    if memory is not None and len(memory):
        st.subheader("Memory")
        st.plotly_chart(figures.memory_figure(memory, (ov.first, ov.last)), width="stretch", key="memory_chart")
        st.caption("The process's memory, read by ampwatch's writer thread about once a second at whatever moment "
                   "of a step that fell: a floor that rises step after step is a leak (the doctor's memory-growth).")

with findings_box:
    doctor_key = f"doctor:{path.name}"
    if row["steps"] <= loaders.AUTO_DOCTOR_STEPS or st.session_state.get(doctor_key):
        found = loaders.guarded(loaders.findings, str(path), key, path=path) or []
    else:
        found = []
        st.button(f"Run the doctor on all {row['steps']:,} steps (may take a minute)", key="run_doctor",
                  on_click=lambda: st.session_state.update({doctor_key: True}))
    if found:
        st.subheader(headlines.findings_heading(found))
    for i, f in enumerate(found):
        if f.get("cause"):
            continue  # shown folded under its cause
        box = st.container(border=True)
        box.markdown(f"{formatting.SEVERITY_BADGE.get(f['severity'], '')} **{f['title']}** "
                     f"· {formatting.step_span(*f['steps'])}")
        box.markdown(f"{f['evidence']}  \n**Fix:** {f['advice']}")
        box.button(f"Show steps {f['jump'][0]}–{f['jump'][1]}", key=f"finding:{i}", on_click=state.jump_to,
                   args=(path, f["jump"][0], f["jump"][1], f["steps"][0]))
        for j, c in enumerate(x for x in found if x.get("cause") == f["id"]):
            with box.expander(f"{c['severity'].upper()} · consequence: {c['title']}",
                              icon=formatting.SEVERITY_ICON.get(c["severity"])):
                st.markdown(f"{c['evidence']}  \n**Fix:** {c['advice']}")
                st.button(f"Show steps {c['jump'][0]}–{c['jump'][1]}", key=f"finding:{i}:{j}", on_click=state.jump_to,
                          args=(path, c["jump"][0], c["jump"][1], c["steps"][0]))
    if row["status"] == "crashed" and row.get("error_tail"):
        st.error("The run crashed. The traceback ends:\n\n```\n" + "\n".join(row["error_tail"]) + "\n```")
origin = headlines.origin_finding(found)
if origin is not None:  # the root cause, not the first overflow the scaler handled
    m[3].metric("NaN/inf born at step", f"{origin['steps'][0]}", help=f"the doctor's root cause: {origin['title']}")
else:
    m[3].metric("first NaN/inf step", formatting.fmt(row["first_nonfinite_step"], "{}"),
                help="after the scaler's warm-up (its expected overflows are not counted); a gradient "
                     "overflow the scaler skipped counts: see the doctor's findings for whether it matters")
with notice_box:
    if any(f.get("id") == "no-loss" for f in found):  # the doctor's: nothing in the whole run
        st.info("No loss was recorded: without a GradScaler pass it each step with watch.log(loss=loss). The loss "
                "chart is empty; the grad norm and the NaN/inf markers are drawn.")
    elif ov is not None and ov.steps["loss"].notna().sum() == 0:
        st.info("Every loss in this range is NaN/inf or missing: the loss chart is empty; the markers show where.")
