"""Step inspector: every recorded figure at one step, per layer and module, sortable."""
import streamlit as st

import headlines
import loaders
import state
import stepview

path, key, row = state.page_run()
st.title(f"Step inspector · {row['name']}")
if not row["steps"]:
    st.info("This run has no steps yet.")
    st.stop()
first, last = int(row["first_step"]), int(row["last_step"])
# where the doctor says a NaN/Inf was born (the overview's headline), else the first NaN/Inf after the
# warm-up (on overflow_storm that is an isolated skip at step 6, not the root cause at step 120)
origin = headlines.origin_finding(loaders.doctor_findings(path, key))
default = origin["steps"][0] if origin is not None else row["first_nonfinite_step"]
default = default if default is not None else last
step = state.inspect_step(first, last, int(default))
stepview.show_step(path, key, step)
