"""Pure Plotly builders for the dashboard: data in, ``go.Figure`` out (no Streamlit, no torch).

Inputs are the plain structures of :mod:`ampwatch.dashboard.rundata`. Every figure sets ``uirevision`` so a
live refresh keeps the user's zoom ("without losing its place").
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..doctor.finding import counted

LOSS_COLOR, SCALE_COLOR, NORM_COLOR, LR_COLOR = "#1f77b4", "#9467bd", "#ff7f0e", "#17becf"
SKIP_COLOR = "#d62728"
GROWTH_COLOR = "#2ca02c"
NONFINITE_COLOR = "#000000"
CLIP_COLOR = "#7f7f7f"
DTYPE_MAX_F16 = 65504.0
OVERVIEW_ROWS = ("loss", "loss scale", "grad norm", "learning rate")
# Plotly labels a short log axis's minor ticks with a bare digit ("5" for 0.5): a tickformat makes
# every label the full number (0.5, 0.2, 20, 1e+5).
LOG_AXIS = {"type": "log", "tickformat": ".3~g"}


def nonfinite_what(metric: str) -> str:
    """What a red heatmap cell means: a non-finite weight on param_norm, else a non-finite gradient."""
    return "weight" if metric == "param_norm" else "gradient"


def _log2_ticks(values: pd.Series) -> dict[str, Any]:
    """Tick every power of two (labelled 2^k) on a log axis: loss scales are powers of two."""
    v = values[np.isfinite(values) & (values > 0)]
    if v.empty:
        return {}
    lo, hi = math.floor(math.log2(v.min())), math.ceil(math.log2(v.max()))
    step = max(1, math.ceil((hi - lo + 1) / 7))  # about 7 labels: the panel is short
    # both ends labelled (a run's first scale and the lowest it fell to), multiples of the step between
    # them, none within half a step of an end (their labels would overlap)
    inner = [k for k in range(math.ceil(lo / step) * step, hi + 1, step) if min(k - lo, hi - k) >= step / 2]
    ks = sorted({lo, hi, *inner})
    return {"tickvals": [2.0 ** k for k in ks], "ticktext": [f"2^{k}" for k in ks]}


def _log_ticks(*values: Any) -> dict[str, Any]:
    """Ticks at 1, 2 and 5 per decade for a log axis spanning about one to three decades, where
    Plotly would label every digit (0.3 0.4 ... 0.9 1 2 3 4: with LOG_AXIS's full numbers they run into
    each other on a short panel); other spans keep Plotly's own (a linear-looking set under one
    decade, one per decade beyond)."""
    v = pd.to_numeric(pd.concat([pd.Series(x, dtype=float) for x in values]), errors="coerce")
    v = v[np.isfinite(v) & (v > 0)]
    if v.empty:
        return {}
    lo, hi = math.log10(v.min()), math.log10(v.max())
    if not 0.8 <= hi - lo < 3:
        return {}
    ticks = [m * 10.0 ** k for k in range(math.floor(lo) - 1, math.ceil(hi) + 2) for m in (1, 2, 5)]
    return {"tickmode": "array", "tickvals": ticks}


def _marker_y(steps: pd.DataFrame, col: str, at: np.ndarray, log: bool) -> np.ndarray:
    """y for a marker at steps ``at``: the series' value there, or the bottom of the plotted range."""
    values = steps.set_index("step")[col].reindex(at).to_numpy(dtype=float)
    finite = steps[col][np.isfinite(steps[col]) & ((steps[col] > 0) if log else True)]
    floor = float(finite.min()) if len(finite) else 1.0
    ok = np.isfinite(values) & ((values > 0) if log else True)
    return np.where(ok, values, floor)


def overview_figure(ov: Any, log_loss: bool = True, height: int = 760, uirevision: Optional[str] = None
                    ) -> go.Figure:
    """Loss, loss scale (log2), grad norm (log) and lr on one shared step axis.

    Skipped steps are red crosses on the loss; non-finite steps black diamonds; scale backoffs and
    growths are red/green triangles; the clip threshold (as seen in the ``clip_grad_norm_`` call,
    else from the config) a dashed line. ``uirevision`` (default: the range's first step) is what
    Plotly compares to keep the user's zoom: a live page passes one constant per run.
    """
    s = ov.steps
    fig = make_subplots(rows=4, cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        row_heights=[0.34, 0.22, 0.26, 0.18], subplot_titles=OVERVIEW_ROWS)
    fig.add_trace(go.Scatter(x=s["step"], y=s["loss"], name="loss", mode="lines",
                             line={"width": 1, "color": LOSS_COLOR}), 1, 1)
    # the skips are drawn over the NaN/inf diamonds: a gradient overflow is both, and a cross under a
    # diamond would leave a run whose every skip overflowed without one visible cross
    if len(ov.nonfinite_steps):
        fig.add_trace(go.Scatter(x=ov.nonfinite_steps, y=_marker_y(s, "loss", ov.nonfinite_steps, log_loss),
                                 name=f"NaN/inf step ({len(ov.nonfinite_steps)})", mode="markers",
                                 marker={"symbol": "diamond", "color": NONFINITE_COLOR, "size": 10}), 1, 1)
    if len(ov.skipped_steps):
        fig.add_trace(go.Scatter(x=ov.skipped_steps, y=_marker_y(s, "loss", ov.skipped_steps, log_loss),
                                 name=f"skipped step ({len(ov.skipped_steps)})", mode="markers",
                                 marker={"symbol": "x", "color": SKIP_COLOR, "size": 7}), 1, 1)
    _scale_traces(fig, s, ov.scale_changes)
    fig.add_trace(go.Scatter(x=s["step"], y=s["grad_norm"], name="grad norm (unscaled, pre-clip)",
                             mode="lines", line={"width": 1, "color": NORM_COLOR}), 3, 1)
    if ov.clip_threshold is not None:
        # named in the legend, not by a text on the line: Plotly widens a log axis's autorange to fit a
        # data-anchored text, which left the grad norms in the bottom third of their panel
        fig.add_hline(y=ov.clip_threshold, line={"dash": "dash", "color": CLIP_COLOR}, row=3, col=1)
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", name=f"clip threshold {ov.clip_threshold:g}",
                                 line={"dash": "dash", "color": CLIP_COLOR}, hoverinfo="skip"), 3, 1)
    fig.add_trace(go.Scatter(x=s["step"], y=s["lr"], name="lr", mode="lines",
                             line={"width": 1, "color": LR_COLOR}), 4, 1)
    lr_max = pd.to_numeric(s["lr"], errors="coerce").max() if len(s) else None
    # an explicit range: Plotly pads a constant series by +-1, which flattens lr = 3e-4 onto zero
    lr_range = [0, 1.15 * float(lr_max)] if lr_max is not None and np.isfinite(lr_max) and lr_max > 0 else None
    fig.update_yaxes(rangemode="tozero", exponentformat="e", range=lr_range, row=4, col=1)
    fig.update_yaxes(**({**LOG_AXIS, **_log_ticks(s["loss"])} if log_loss else {"type": "linear"}), row=1, col=1)
    fig.update_yaxes(type="log", row=2, col=1, **_log2_ticks(s["loss_scale"]))
    clip = [] if ov.clip_threshold is None else [ov.clip_threshold]
    fig.update_yaxes(**LOG_AXIS, **_log_ticks(s["grad_norm"], clip), row=3, col=1)
    fig.update_xaxes(title_text="step", row=4, col=1)
    if uirevision is None:
        uirevision = str(getattr(ov, "first", ""))
    fig.update_layout(height=height, hovermode="x unified", uirevision=uirevision,
                      margin={"l": 60, "r": 20, "t": 40, "b": 40}, legend={"orientation": "h", "y": -0.08})
    return fig


def scale_note(s: pd.DataFrame) -> Optional[str]:
    """Why the loss-scale panel is empty or has gaps (a log axis cannot draw 0), or None."""
    scale = pd.to_numeric(s["loss_scale"], errors="coerce")
    if not scale.notna().any():
        return "no loss scale recorded: no GradScaler (bf16 / fp32 runs need none)"
    zero = s["step"][scale <= 0]
    if len(zero):
        where = (f"step {int(zero.iloc[0])}" if len(zero) == 1
                 else f"{counted(len(zero), 'step')} ({int(zero.iloc[0])}–{int(zero.iloc[-1])})")
        return f"scale 0 at {where}: not drawable on a log axis, a gap"
    return None


def _scale_traces(fig: go.Figure, s: pd.DataFrame, changes: pd.DataFrame) -> None:
    note = scale_note(s)
    if note:  # said in the panel itself, so an empty or broken line is never silent
        # placed on the page by the panel's domain: Plotly drops the axes of a panel without traces, so
        # "x2 domain" fell back to the loss axes (the note in the loss panel at step 0.5, the shared
        # step axis stretched to -70 to fit it)
        xd, yd = fig.layout.xaxis2.domain, fig.layout.yaxis2.domain
        fig.add_annotation(text=note, xref="paper", yref="paper", x=(xd[0] + xd[1]) / 2, y=(yd[0] + yd[1]) / 2,
                           showarrow=False, font={"color": "#7f7f7f"}, bgcolor="rgba(255,255,255,0.8)")
    if s["loss_scale"].notna().any():
        fig.add_trace(go.Scatter(x=s["step"], y=s["loss_scale"], name="loss scale", mode="lines",
                                 line={"shape": "hv", "width": 1.5, "color": SCALE_COLOR}), 2, 1)
    for kind, symbol, color in (("backoff", "triangle-down", SKIP_COLOR), ("growth", "triangle-up", GROWTH_COLOR)):
        ev = changes[changes["kind"] == kind] if len(changes) else changes
        if len(ev):
            fig.add_trace(go.Scatter(x=ev["step"], y=ev["loss_scale"], name=f"scale {kind} ({len(ev)})",
                                     mode="markers", marker={"symbol": symbol, "color": color, "size": 8}), 2, 1)


def _heatmap_columns(grid: Any) -> tuple[np.ndarray, np.ndarray]:
    """The heatmap's x and each cell's step (for hover). Columns of one recorded step each are given
    as cell edges (one more than the columns): a cell runs from its step to the next recorded one.
    Given as centres, plotly would stretch a lone skipped step between two ``layer_every`` steps
    halfway to each neighbour (a skip at 53 drawn from 45). An axis of equal columns instead (a
    category axis) was tried and dropped: 70 skipped steps then outweigh 180 healthy ones."""
    starts = np.asarray(grid.bucket_starts)
    steps = np.tile(starts, (len(grid.names), 1))
    if grid.width != 1 or len(starts) == 0:
        return starts, steps
    return np.append(starts, starts[-1] + 1), steps


def heatmap_figure(grid: Any, log_color: bool = True, height: Optional[int] = None) -> go.Figure:
    """Layers x steps heatmap of one metric (log10 colour by default); non-finite cells in red.
    On a linear step axis; where each column is one recorded step, its cell runs from that step to
    the next recorded one, so a lone skipped step starts where it happened."""
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(grid.values > 0, np.log10(grid.values), np.nan) if log_color else grid.values
    label = f"log10 {grid.metric}" if log_color else grid.metric
    x, steps = _heatmap_columns(grid)
    hover = "step %{text}<br>%{y}<br>" + label + " %{z:.3g}<extra></extra>"
    if grid.width > 1:
        hover = f"steps %{{text}}..+{grid.width - 1}<br>%{{y}}<br>max {label} %{{z:.3g}}<extra></extra>"
    names = grid.labels  # a tied parameter shows all its names
    fig = go.Figure(go.Heatmap(z=z, x=x, y=names, text=steps, colorscale="Viridis",
                               colorbar={"title": label}, hovertemplate=hover, hoverongaps=False))
    what = nonfinite_what(grid.metric)
    if grid.nonfinite.any():  # a second, single-colour layer: NaN/inf cells stand out in red
        fig.add_trace(go.Heatmap(z=np.where(grid.nonfinite, 1.0, np.nan), x=x, y=names, text=steps,
                                 colorscale=[[0, SKIP_COLOR], [1, SKIP_COLOR]], showscale=False, showlegend=True,
                                 name=f"NaN/inf {what} ({int(grid.nonfinite.sum())} cells)", hoverongaps=False,
                                 hovertemplate="step %{text}<br>%{y}<br>NaN/inf " + what + "<extra></extra>"))
    n = len(grid.names)
    fig.update_layout(height=height or min(2400, max(320, 18 * n + 120)), xaxis={"type": "linear", "title": "step"},
                      yaxis={"autorange": "reversed", "type": "category", "dtick": 1 if n <= 80 else None},
                      uirevision=grid.metric, margin={"l": 160, "r": 20, "t": 30, "b": 40},
                      legend={"orientation": "h", "y": 1.05})
    return fig


PHASE_COLOR = {"forward": "#1f77b4", "backward": "#9467bd"}


def headroom_figure(df: pd.DataFrame, warn_factor: float = 4.0) -> go.Figure:
    """Max |value| per module and phase against the dtype limit (log x); modules within
    ``warn_factor`` of the limit are red. An overflowed module (amax inf/NaN: a log axis cannot draw
    it) is a hatched red bar drawn past the limit, labelled inf/NaN. The legend's swatches are their
    own entries, so a phase's colour is never taken from a red bar."""
    fig = go.Figure()
    limit = float(df["limit"].iloc[0]) if len(df) else DTYPE_MAX_F16
    past = 2.0 * limit  # where an overflowed bar ends: visibly beyond the dashed limit
    for phase in ("forward", "backward"):
        d = df[df["phase"] == phase]
        if d.empty:
            continue
        amax = d["amax"].to_numpy(dtype=float)
        bad = ~np.isfinite(amax)
        colors = np.where(bad | (d["headroom"] <= warn_factor), SKIP_COLOR, PHASE_COLOR[phase])
        shown = ["inf" if np.isposinf(v) else "NaN" if np.isnan(v) else f"{v:.3g}" for v in amax]
        fig.add_trace(go.Bar(x=np.where(bad, past, amax), y=d["module"], orientation="h", showlegend=False,
                             cliponaxis=False,
                             name=f"{phase} max |value|", offsetgroup=phase, customdata=np.c_[d["headroom"], shown],
                             marker={"color": colors, "pattern": {"shape": np.where(bad, "x", "").tolist()}},
                             text=np.where(bad, shown, ""), textposition="outside",
                             hovertemplate="%{y}<br>max |value| %{customdata[1]}<br>headroom x%{customdata[0]:.3g}"
                                           "<extra>" + phase + "</extra>"))
        fig.add_trace(go.Bar(x=[None], y=[None], name=f"{phase} max |value|", offsetgroup=phase,
                             marker={"color": PHASE_COLOR[phase]}, hoverinfo="skip"))
    if len(df):
        if (df["headroom"] <= warn_factor).any() or (~np.isfinite(df["amax"].astype(float))).any():
            fig.add_trace(go.Bar(x=[None], y=[None], name=f"within {warn_factor:g}x of the limit",
                                 offsetgroup="forward", marker={"color": SKIP_COLOR}, hoverinfo="skip"))
        if (~np.isfinite(df["amax"].astype(float))).any():
            fig.add_trace(go.Bar(x=[None], y=[None], name="overflowed (inf/NaN), drawn past the limit",
                                 offsetgroup="forward", marker={"color": SKIP_COLOR, "pattern": {"shape": "x"}},
                                 hoverinfo="skip"))
        fig.add_vline(x=limit, line={"dash": "dash", "color": SKIP_COLOR})
        # a paper-anchored label above the plot: a vline annotation on a log axis is placed in data units
        fig.add_annotation(x=math.log10(limit), xref="x", y=1.0, yref="paper", yanchor="bottom",
                           text=f"dtype max {limit:.6g}", showarrow=False, font={"color": SKIP_COLOR})
    fig.update_layout(barmode="group", xaxis={**LOG_AXIS, "title": "max |value| (backward: scaled grad)"},
                      yaxis={"autorange": "reversed", "type": "category"},
                      height=max(360, 16 * df["module"].nunique() + 160) if len(df) else 360,
                      margin={"l": 160, "r": 40, "t": 80, "b": 40},
                      legend={"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 0, "xanchor": "left"})
    return fig


def zero_grad_figure(df: pd.DataFrame) -> go.Figure:
    """Mean (bar) and max (marker) fraction of exactly-zero gradient elements per layer."""
    layers = [f"{n} = {a}" if isinstance(a, str) and a else n
              for n, a in zip(df["layer"], df["aliases"] if "aliases" in df else [""] * len(df))]
    fig = go.Figure(go.Bar(x=df["zero_frac_mean"], y=layers, orientation="h", name="mean zero fraction"))
    fig.add_trace(go.Scatter(x=df["zero_frac_max"], y=layers, mode="markers", name="max zero fraction",
                             marker={"symbol": "line-ns-open", "size": 12, "color": SKIP_COLOR}))
    fig.update_layout(xaxis={"title": "fraction of gradient elements exactly 0", "range": [0, 1]},
                      yaxis={"autorange": "reversed", "type": "category"},
                      height=max(320, 14 * len(df) + 120), margin={"l": 160, "r": 20, "t": 30, "b": 40},
                      legend={"orientation": "h", "y": 1.05})
    return fig


MEMORY_TRACES = (("host_rss", "host (resident)", "#7f7f7f"), ("device_allocated", "device: tensors", NORM_COLOR),
                 ("device_reserved", "device: reserved", SCALE_COLOR))


def memory_figure(df: pd.DataFrame, steps: Optional[tuple[int, int]] = None, height: int = 300) -> go.Figure:
    """The process's memory by step, in MiB: one line per figure the run read; ``steps``: the
    range the step charts above show (readings start at the first commit, not at step 0)."""
    fig = go.Figure()
    for column, label, color in MEMORY_TRACES:
        values = df[column] if column in df else pd.Series(dtype=float)
        if values.notna().any():
            fig.add_trace(go.Scatter(x=df["step"], y=values / 2 ** 20, name=label, mode="lines",
                                     line={"color": color}, connectgaps=True,
                                     hovertemplate="step %{x}: %{y:,.1f} MiB<extra>" + label + "</extra>"))
    fig.update_layout(height=height, margin={"l": 60, "r": 20, "t": 30, "b": 40}, showlegend=True,
                      xaxis={"title": "step", **({"range": list(steps)} if steps else {})},
                      yaxis={"title": "MiB", "rangemode": "tozero"}, legend={"orientation": "h", "y": 1.1})
    return fig


def compare_figure(runs: Mapping[str, Any], skip_rates: Mapping[str, pd.DataFrame],
                   log_loss: bool = True) -> go.Figure:
    """Several runs overlaid: loss, loss scale, grad norm and skip rate on one shared step axis."""
    titles = ("loss", "loss scale", "grad norm", "skip rate (fraction of steps skipped)")
    fig = make_subplots(rows=4, cols=1, shared_xaxes=True, vertical_spacing=0.04, subplot_titles=titles)
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]
    for i, (name, ov) in enumerate(runs.items()):
        color = palette[i % len(palette)]
        s = ov.steps
        for row, col in ((1, "loss"), (2, "loss_scale"), (3, "grad_norm")):
            fig.add_trace(go.Scatter(x=s["step"], y=s[col], name=name, legendgroup=name, showlegend=row == 1,
                                     mode="lines", line={"color": color, "width": 1,
                                                         "shape": "hv" if col == "loss_scale" else "linear"}),
                          row, 1)
        rate = skip_rates.get(name)
        if rate is not None and len(rate):
            fig.add_trace(go.Scatter(x=rate["step"], y=rate["rate"], name=name, legendgroup=name, showlegend=False,
                                     mode="lines", line={"color": color, "shape": "hv"}), 4, 1)
    all_scales = pd.concat([ov.steps["loss_scale"] for ov in runs.values()]) if runs else pd.Series(dtype=float)
    losses = [ov.steps["loss"] for ov in runs.values()]
    norms = [ov.steps["grad_norm"] for ov in runs.values()]
    fig.update_yaxes(**({**LOG_AXIS, **_log_ticks(*losses)} if log_loss else {"type": "linear"}), row=1, col=1)
    fig.update_yaxes(type="log", row=2, col=1, **_log2_ticks(all_scales))
    fig.update_yaxes(**LOG_AXIS, **_log_ticks(*norms), row=3, col=1)
    fig.update_yaxes(range=[0, 1], row=4, col=1)
    fig.update_xaxes(title_text="step", row=4, col=1)
    fig.update_layout(height=820, hovermode="x unified", uirevision="compare",
                      margin={"l": 60, "r": 20, "t": 40, "b": 40}, legend={"orientation": "h", "y": -0.06})
    return fig


RANK_PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]


def ranks_figure(steps: pd.DataFrame, global_steps: pd.DataFrame, first: Optional[Mapping[str, Any]] = None,
                 selected: Optional[int] = None, height: int = 720) -> go.Figure:
    """Per-rank loss and grad norm on one step axis, the global grad norm, skipped agreement, and the
    first rank to go non-finite.

    :param steps: per-rank rows ``rank, step, loss, grad_norm`` (``GroupOverview.steps``).
    :param global_steps: ``step, grad_norm, skipped, skipped_agree, skipped_ranks, ranks``.
    :param first: ``{"step", "rank", "module", "phase"}`` of the first NaN/Inf (marked with a star).
    :param selected: a rank drawn thicker and on top; the others fade.

    Each per-rank trace carries its rank in ``customdata`` and ``meta``, so a click on the chart
    says which rank was picked.
    """
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.06, row_heights=[0.42, 0.38, 0.2],
                        subplot_titles=("loss per rank", "grad norm per rank (black: global)", "skipped steps"))
    ranks = sorted(int(r) for r in steps["rank"].unique()) if len(steps) else []
    for i, rank in enumerate(ranks):
        d = steps[steps["rank"] == rank]
        color = RANK_PALETTE[i % len(RANK_PALETTE)]
        faded = selected is not None and rank != selected
        line = {"width": 2.5 if rank == selected else 1, "color": "#c8c8c8" if faded else color}
        for row, col in ((1, "loss"), (2, "grad_norm")):
            fig.add_trace(go.Scatter(x=d["step"], y=d[col], name=f"rank {rank}", legendgroup=f"rank {rank}",
                                     showlegend=row == 1, mode="lines+markers", marker={"size": 3},
                                     line=line, customdata=np.full(len(d), rank), meta=rank,
                                     hovertemplate=f"rank {rank}<br>step %{{x}}<br>{col} %{{y:.4g}}<extra></extra>"),
                          row, 1)
    g = global_steps
    if len(g):
        fig.add_trace(go.Scatter(x=g["step"], y=g["grad_norm"], name="global grad norm", mode="lines",
                                 line={"width": 1.5, "color": NONFINITE_COLOR}), 2, 1)
        skipped = g[g["skipped"].astype(bool)]
        agree, disagree = skipped[skipped["skipped_agree"].astype(bool)], skipped[~skipped["skipped_agree"].astype(bool)]
        for d, name, color, symbol in ((agree, "skipped on every rank", SKIP_COLOR, "x"),
                                       (disagree, "ranks disagree", "#ff00ff", "diamond")):
            if len(d):
                fig.add_trace(go.Scatter(x=d["step"], y=d["skipped_ranks"], mode="markers",
                                         name=f"{name} ({len(d)})", marker={"symbol": symbol, "color": color,
                                                                             "size": 8}), 3, 1)
    if first is not None:
        y = steps[(steps["rank"] == first["rank"]) & (steps["step"] <= first["step"])]["loss"].astype(float)
        y = y[np.isfinite(y)]
        where = f"{first.get('module')} ({first.get('phase')})" if first.get("module") else "NaN/Inf"
        fig.add_trace(go.Scatter(x=[first["step"]], y=[float(y.iloc[-1]) if len(y) else 0.0], mode="markers+text",
                                 name=f"first NaN/Inf: rank {first['rank']}", text=[f"rank {first['rank']}"],
                                 textposition="top center", customdata=[first["rank"]], meta=int(first["rank"]),
                                 marker={"symbol": "star", "size": 16, "color": NONFINITE_COLOR},
                                 hovertemplate=f"first NaN/Inf<br>rank {first['rank']} · step {first['step']}"
                                               f"<br>{where}<extra></extra>"), 1, 1)
    fig.update_yaxes(type="log", row=2, col=1)
    fig.update_yaxes(title_text="ranks", rangemode="tozero", row=3, col=1)
    fig.update_xaxes(title_text="step", row=3, col=1)
    fig.update_layout(height=height, hovermode="closest", uirevision="ranks", clickmode="event+select",
                      margin={"l": 60, "r": 20, "t": 40, "b": 40}, legend={"orientation": "h", "y": -0.08})
    return fig
