"""Step inspector: every recorded figure at one step, per layer and module, sortable."""
import streamlit as st

import shared

path = shared.require_run()
if path is None:
    st.stop()
key = shared.stamp(path)
row = shared.guarded(shared.run_row, str(path), key, path=path)
if row is None:
    st.stop()
st.title(f"Step inspector · {row['name']}")
if not row["steps"]:
    st.info("This run has no steps yet.")
    st.stop()
first, last = int(row["first_step"]), int(row["last_step"])
default = row["first_nonfinite_step"] if row["first_nonfinite_step"] is not None else last
step = shared.inspect_step(first, last, int(default))
shared.show_step(path, key, step)
