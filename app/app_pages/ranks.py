"""Ranks: the ranks of the chosen run's distributed job on one step axis; pick a rank from the chart."""
import streamlit as st

import formatting
import loaders
import state
from ampwatch.dashboard import figures
from ampwatch.doctor.origins import place
from ampwatch.doctor.warmup import WARMUP_NOTE

path, key, row = state.page_run()
folder = st.session_state["_folder"]
view = loaders.guarded(loaders.job_view, str(folder), loaders.folder_stamp(folder), path.name, path=path)
if view is None:
    st.stop()
st.title(f"Ranks of {view.name}")
if view.world_size <= 1 and len(view.files) <= 1:
    st.info(f"`{path.name}` is a single-process run: there are no other ranks. Under torch.distributed each "
            "rank writes its own file; put them in one folder and pick any of them in the sidebar.")
    st.stop()
st.caption(f"{len(view.files)} of {view.world_size} ranks · {view.grad_sharding} gradients"
           + (f" · job id `{view.job_id}`" if view.job_id else " · grouped by file name and start time")
           + (f" · every {view.every:,}th step + every skip and NaN/inf drawn" if view.every > 1 else ""))
if view.missing or view.unreadable:
    lines = [f"rank {r}: no file" for r in view.missing]
    lines += [f"{'rank ' + str(r) if r is not None else f}: {why}" for r, f, why in view.unreadable]
    st.warning("Not every rank can be read; the figures cover the others.  \n" + "  \n".join(lines))
for f in view.findings:
    box = st.container(border=True)
    box.markdown(f"{formatting.SEVERITY_BADGE.get(f['severity'], '')} **{f['title']}**")
    box.markdown(f"{f['evidence']}  \n**Fix:** {f['advice']}")

ranks = sorted(view.files)
if st.session_state.get("ranks_pick") not in ranks:
    st.session_state["ranks_pick"] = view.first["rank"] if view.first else ranks[0]


def _picked() -> None:
    points = st.session_state["ranks_chart"].selection.get("points") or []
    picked = [p.get("customdata") for p in points if p.get("customdata") is not None]
    if picked:
        rank = picked[0][0] if isinstance(picked[0], list) else picked[0]
        if int(rank) in view.files:
            st.session_state["ranks_pick"] = int(rank)


selected = st.selectbox("Rank", ranks, key="ranks_pick", help="or click a rank's line in the chart")
st.plotly_chart(figures.ranks_figure(view.steps, view.global_steps, view.first, selected), width="stretch",
                key="ranks_chart", on_select=_picked, selection_mode="points")
if view.first:
    fst = view.first
    where = place(fst["module"], fst["phase"]) if fst["module"] else "its loss or grad norm"
    others = [r for r in fst["ranks"] if r != fst["rank"]]
    st.markdown(f"**First NaN/Inf:** rank {fst['rank']} at step {fst['step']:,}, {where}"
                + (f", micro-batch {fst['micro_batch']}" if fst["micro_batch"] is not None else "")
                + (f" (also rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} at that step)"
                   if others else "")
                + (f": {WARMUP_NOTE}" if fst.get("warmup") else ""))
ranks_shown = formatting.readable(view.ranks, {"last_loss": "NaN"})  # a NaN loss is not a missing one
ranks_shown["first_nonfinite_step"] = formatting.steps_column(ranks_shown["first_nonfinite_step"])
formatting.table(ranks_shown, hide_index=True, key="ranks_table", column_config={
    "first_nonfinite_step": st.column_config.NumberColumn(
        "first NaN/inf step", format="%d", help="any NaN/Inf, the scaler's warm-up included (the Runs page counts from its end)"),
    "last_loss": "last loss"})
st.button(f"Open rank {selected}'s run ({view.files[selected]})", key="ranks_open", on_click=state.open_run,
          args=(view.files[selected],))
st.page_link("app_pages/overview.py", label="Run overview of the chosen run", icon=":material/show_chart:")
formatting.download(view.global_steps, f"{view.name}_global_steps.csv", "Download global steps (CSV)")
