"""FP8: what each fp8 layer's casts lose over the run (flush-to-zero share, amax, output error)."""
import streamlit as st

import formatting
import loaders
import state
from ampwatch.dashboard import figures
from ampwatch.doctor.finding import counted

LABELS = {"flush_frac": "Flushed to zero (share of nonzero values)", "amax": "amax",
          "rel_err": "fp8 output error (vs high precision)", "sat_frac": "Saturated (share)"}

path, key, row = state.page_run()
st.title(f"FP8 · {row['name']}")
if not row["steps"]:
    st.info("This run has no steps yet.")
    st.stop()
start, end = state.step_range(path, row["first_step"], row["last_step"])
metric = st.segmented_control("Figure", list(LABELS), format_func=LABELS.get,
                              key=state.kept("fp8_metric", "flush_frac")) or "flush_frac"
g = loaders.guarded(loaders.fp8_grid, str(path), key, metric, start, end, path=path)
if g is None:
    st.stop()
if g.values.size == 0:
    st.info("No fp8 rows in this range (they are written every `layer_every` steps).")
    st.stop()
st.plotly_chart(figures.heatmap_figure(g, log_color=loaders.FP8_METRICS[metric][1]), width="stretch",
                key="fp8_heatmap")
st.caption(f"{counted(len(g.names), 'layer cast')} × {counted(g.values.shape[1], 'column')} of "
           f"{counted(g.width, 'step')}: the max in each; {counted(int(g.nonfinite.sum()), 'cell')} saw NaN/inf "
           "in the tensor (red). See docs/fp8.md.")
formatting.download(loaders.grid_frame(g), f"{path.stem}_fp8_{metric}.csv")
table = loaders.guarded(loaders.fp8_summary, str(path), key, path=path)
if table is not None:
    st.dataframe(table, hide_index=True, key="fp8_table")
