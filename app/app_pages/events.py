"""Events: NaN/Inf events, origin first; selecting one jumps the charts there and inspects the step."""
import streamlit as st

import formatting
import headlines
import loaders
import state
import stepview

path = state.require_run()
if path is None:
    st.stop()
key = loaders.stamp(path)
st.title("NaN/Inf events")
ev = loaders.guarded(loaders.events, str(path), key, path=path)
if ev is None:
    st.stop()
if ev.empty:
    st.success("No NaN/Inf events in this run: no module produced a non-finite value.")
    st.stop()
origins = ev[ev["origin"]]
kind, text = headlines.events_headline(ev, loaders.doctor_findings(path, key))
getattr(st, kind)(text)
only_origin = st.toggle("origins only", key=state.kept("events_origin_only", False))
shown = (origins if only_origin else ev).reset_index(drop=True)


def _select() -> None:
    rows = st.session_state["events_table"].selection.rows
    if rows:
        step = int(shown["step"].iloc[rows[0]])
        state.jump_to(path, step - 20, step + 20, inspect=step)


# amax NULL is a NaN gradient's; fp32_amax/lowp_amax NULL: not recomputed (only forward origins are)
shown_text = formatting.readable(shown, {"amax": "NaN", **{c: "–" for c in ("fp32_amax", "lowp_amax") if c in shown}})
st.dataframe(shown_text, key="events_table", on_select=_select, selection_mode="single-row", hide_index=True,
             column_config={"origin": st.column_config.CheckboxColumn("origin", help="where the NaN/Inf was born"),
                            "warmup": st.column_config.CheckboxColumn(
                                "warm-up", help="gradient overflow during the scaler's warm-up: expected")})
st.caption(f"{len(shown):,} events · select one to jump the charts to its step and inspect it.")
formatting.download(shown, f"{path.stem}_events.csv")

step = st.session_state.get("_inspect")
if step is not None and int(step) in set(ev["step"]):
    st.page_link("app_pages/overview.py", label=f"Charts around step {step}", icon=":material/show_chart:")
    stepview.show_step(path, key, int(step))
