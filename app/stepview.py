"""One step in full, as tables: the Step inspector's body, also shown under the Events table."""
from __future__ import annotations

from pathlib import Path

import streamlit as st

import loaders
from formatting import download, readable


def show_step(path: Path, key: tuple, step: int) -> None:
    """Every recorded figure at ``step``: the step row, events, layers, modules, metrics (sortable)."""
    detail = loaders.guarded(loaders.step_detail, str(path), key, step, path=path)
    if detail is None:
        return
    st.subheader(f"Step {step}")
    if detail["step"].empty:
        st.info(f"Step {step} was not recorded in this run.")
        return
    st.dataframe(detail["step"], hide_index=True, key="step_row")
    if len(detail["events"]):
        st.markdown("**NaN/Inf events** (origin first)")
        ev = detail["events"]
        nan_text = {"amax": "NaN", **({"fp32_amax": "–"} if "fp32_amax" in ev else {})}
        st.dataframe(readable(ev, nan_text), hide_index=True, key="step_events")
    if detail["layers"].empty:
        near = detail["layer_step_at_or_before"]
        st.info(f"No per-layer rows at step {step}: they are written every `layer_every` steps, on skipped "
                "or non-finite steps, and on steps whose gradient norm or loss spiked" + (f"; the nearest earlier one is step {near}." if near is not None else "."))
    else:
        st.markdown("**Per layer** (click a header to sort)")
        st.dataframe(detail["layers"], hide_index=True, key="step_layers")
        download(detail["layers"], f"{path.stem}_step{step}_layers.csv", "Download layers (CSV)")
    if len(detail["modules"]):
        st.markdown("**Per module** (max |value|; backward is the scaled gradient)")
        st.dataframe(detail["modules"], hide_index=True, key="step_modules")
    if len(detail["metrics"]):
        st.markdown("**Logged metrics**")
        st.dataframe(detail["metrics"], hide_index=True, key="step_metrics")
    inputs = detail.get("inputs")
    if inputs is not None and len(inputs):
        st.markdown("**Saved input batch** (the model's inputs of this step, kept in the run file to run it again)")
        st.dataframe(inputs, hide_index=True, key="step_inputs")
        st.caption(f"As torch tensors: `ampwatch batch {path.name} --step {step} --out step{step}.pt`, or "
                   f"`ampwatch.load_batch(run, {step})` in Python.")
        arrays = loaders.guarded(loaders.input_arrays, str(path), key, step, path=path)
        if arrays:
            st.download_button("Download the inputs (NumPy .npz)", arrays, file_name=f"{path.stem}_step{step}_inputs.npz",
                               mime="application/octet-stream", key=f"dl:inputs:{step}")
