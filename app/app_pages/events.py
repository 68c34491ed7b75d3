"""Events: NaN/Inf events, origin first; selecting one jumps the charts there and inspects the step."""
import streamlit as st

import shared

path = shared.require_run()
if path is None:
    st.stop()
key = shared.stamp(path)
st.title("NaN/Inf events")
ev = shared.guarded(shared.events, str(path), key, path=path)
if ev is None:
    st.stop()
if ev.empty:
    st.success("No NaN/Inf events in this run: no module produced a non-finite value.")
    st.stop()
origins = ev[ev["origin"]]
first = ev.iloc[0]  # the first event, warm-up included (events are in step order, origins first)
text = f"First event: **{first['module']}** ({first['phase']}, {first['kind']}) at step {first['step']}"
if len(origins) and origins.index[0] != ev.index[0]:
    o = origins.iloc[0]
    text += f"; first origin: **{o['module']}** ({o['phase']}, {o['kind']}) at step {o['step']}"
st.warning(text)
only_origin = st.toggle("origins only", value=False, key="events_origin_only")
shown = (origins if only_origin else ev).reset_index(drop=True)


def _select() -> None:
    rows = st.session_state["events_table"].selection.rows
    if rows:
        step = int(shown["step"].iloc[rows[0]])
        shared.jump_to(path, step - 20, step + 20, inspect=step)


st.dataframe(shown, key="events_table", on_select=_select, selection_mode="single-row", hide_index=True,
             column_config={"origin": st.column_config.CheckboxColumn("origin", help="where the NaN/Inf was born")})
st.caption(f"{len(shown):,} events · select one to jump the charts to its step and inspect it.")
shared.download(shown, f"{path.stem}_events.csv")

step = st.session_state.get("_inspect")
if step is not None and int(step) in set(ev["step"]):
    st.page_link("app_pages/overview.py", label=f"Charts around step {step}", icon=":material/show_chart:")
    shared.show_step(path, key, int(step))
