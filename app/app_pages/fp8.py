"""FP8: what each fp8 layer's casts lose over the run (flush-to-zero share, amax, output error)."""
import streamlit as st

import shared
from ampwatch.dashboard import figures
from ampwatch.dashboard import fp8 as fp8data
from ampwatch.dashboard.layerdata import grid_frame

LABELS = {"flush_frac": "Flushed to zero (share of nonzero values)", "amax": "amax",
          "rel_err": "fp8 output error (vs high precision)", "sat_frac": "Saturated (share)"}


@st.cache_data(show_spinner="Reading fp8 layers...", max_entries=32)
def grid(path: str, key: tuple, metric: str, start: int, end: int):
    return fp8data.fp8_grid(path, metric, start, end)


@st.cache_data(show_spinner=False, max_entries=32)
def summary(path: str, key: tuple):
    return fp8data.fp8_summary(path)


path, key, row = shared.page_run()
st.title(f"FP8 · {row['name']}")
if not row["steps"]:
    st.info("This run has no steps yet.")
    st.stop()
start, end = shared.step_range(path, row["first_step"], row["last_step"])
metric = st.segmented_control("Figure", list(LABELS), format_func=LABELS.get, default="flush_frac",
                              key="fp8_metric") or "flush_frac"
g = shared.guarded(grid, str(path), key, metric, start, end, path=path)
if g is None:
    st.stop()
if g.values.size == 0:
    st.info("No fp8 rows in this range (they are written every `layer_every` steps).")
    st.stop()
st.plotly_chart(figures.heatmap_figure(g, log_color=fp8data.FP8_METRICS[metric][1]), width="stretch",
                key="fp8_heatmap")
st.caption(f"{len(g.names)} layer casts × {g.values.shape[1]} columns of {g.width:,} step(s): the max in each; "
           f"{int(g.nonfinite.sum())} cells saw NaN/inf in the tensor (red). See docs/fp8.md.")
shared.download(grid_frame(g), f"{path.stem}_fp8_{metric}.csv")
table = shared.guarded(summary, str(path), key, path=path)
if table is not None:
    st.dataframe(table, hide_index=True, key="fp8_table")
