"""Step inspector: every recorded figure at one step, per layer and module, sortable."""
import streamlit as st

import state
import stepview

path, key, row = state.page_run()
st.title(f"Step inspector · {row['name']}")
if not row["steps"]:
    st.info("This run has no steps yet.")
    st.stop()
first, last = int(row["first_step"]), int(row["last_step"])
default = row["first_nonfinite_step"] if row["first_nonfinite_step"] is not None else last
step = state.inspect_step(first, last, int(default))
stepview.show_step(path, key, step)
