"""Layers: per-layer gradient heatmap, fp16 headroom per module, zero-gradient fraction per layer."""
import streamlit as st

import formatting
import loaders
import state
from ampwatch.dashboard import figures
from ampwatch.doctor.finding import counted

path, key, row = state.page_run()
st.title(f"Layers · {row['name']}")
if not row["steps"]:
    st.info("This run has no steps yet.")
    st.stop()
start, end = state.step_range(path, row["first_step"], row["last_step"])
view = st.segmented_control("View", ["Gradient heatmap", "fp16 headroom", "Zero gradients"],
                            key=state.kept("layers_view", "Gradient heatmap")) or "Gradient heatmap"

if view == "Gradient heatmap":
    metric = st.selectbox("Figure", loaders.LAYER_METRICS, key=state.kept("layers_metric", "grad_norm"))
    grid = loaders.guarded(loaders.heatmap, str(path), key, metric, start, end, path=path)
    if grid is None:
        st.stop()
    if grid.values.size == 0:
        st.info("No per-layer rows in this range (they are written every `layer_every` steps, on bad steps and on spikes).")
        st.stop()
    log = st.toggle("log colour scale", key=state.kept(f"layers_log:{metric}", metric != "grad_zero_frac"))
    st.plotly_chart(figures.heatmap_figure(grid, log_color=log), width="stretch", key="heatmap")
    bad = int(grid.nonfinite.sum())
    st.caption(f"{counted(len(grid.names), 'layer')} × {counted(grid.values.shape[1], 'column')} of "
               f"{counted(grid.width, 'step')}: the max in each; {counted(bad, 'cell')} "
               f"{'holds' if bad == 1 else 'hold'} a NaN/inf {figures.nonfinite_what(metric)} (red)."
               + (" NaN/inf gradients are not marked here: the weights' norms are shown."
                  if metric == "param_norm" else ""))
    table = loaders.grid_frame(grid)
    formatting.download(table, f"{path.stem}_{metric}_heatmap.csv")
elif view == "fp16 headroom":
    df = loaders.guarded(loaders.headroom, str(path), key, start, end, path=path)
    if df is None:
        st.stop()
    if df.empty:
        st.info("No per-module rows: the run was recorded with localize=False, or has no detail steps yet.")
        st.stop()
    near = df[df["headroom"] <= 4]
    if len(near):
        named = ", ".join(f"{m} ({p})" for m, p in near[["module", "phase"]].head(8).itertuples(index=False))
        st.warning(f"{counted(len(near), 'module/phase pair')} came within 4x of the {df['limit'].iloc[0]:.6g} "
                   f"limit: {named}" + (f" (+{len(near) - 8} more in the table)" if len(near) > 8 else ""))
    st.plotly_chart(figures.headroom_figure(df), width="stretch", key="headroom")
    st.dataframe(df, hide_index=True, key="headroom_table")
    formatting.download(df, f"{path.stem}_headroom.csv")
else:
    df = loaders.guarded(loaders.zero_grads, str(path), key, start, end, path=path)
    if df is None:
        st.stop()
    st.plotly_chart(figures.zero_grad_figure(df), width="stretch", key="zero_grads")
    st.dataframe(df, hide_index=True, key="zero_table")
    formatting.download(df, f"{path.stem}_zero_grads.csv")
