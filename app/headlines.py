"""Headline texts of the dashboard: short, plain strings built from shown data (no Streamlit calls)."""
from __future__ import annotations

from typing import Any

import pandas as pd

from ampwatch.doctor.finding import counted


def findings_heading(found: list[dict]) -> str:
    """'Root causes' only over something to fix; notes that say 'nothing to fix' are not causes."""
    return "Root causes" if any(f["severity"] != "info" for f in found) else "Notes from the doctor (nothing to fix)"


def origin_finding(found: list[dict]) -> dict | None:
    """The doctor's root cause that names where a NaN/Inf was born, if any."""
    return next((f for f in found if f.get("id") == "nonfinite-origin" and not f.get("cause")), None)


def _event_text(e: Any) -> str:
    if e["phase"] == "input":  # the batch brought it: no module
        return f"**the model's input batch** ({e['kind']}) at step {e['step']}"
    return f"**{e['module']}** ({e['phase']}, {e['kind']}) at step {e['step']}"


def events_headline(ev: pd.DataFrame, found: list[dict]) -> tuple[str, str]:
    """(st function name, text) above the events table: the doctor's root cause first when it has
    one, then the first event after the scaler's warm-up; warm-up overflow is labelled expected."""
    lines, kind = [], "info"
    cause = origin_finding(found)
    if cause is not None:
        lines.append(f"Root cause (doctor): **{cause['title']}**")
        kind = "warning"  # st.error is kept for "cannot show this": a finding is a warning box
    real = ev[~ev["warmup"]]
    if len(real):
        origins = real[real["origin"]]
        lines.append(f"First event after the scaler's warm-up: {_event_text(real.iloc[0])}"
                     + (f"; first origin: {_event_text(origins.iloc[0])}"
                        if len(origins) and origins.index[0] != real.index[0] else ""))
        # yellow when something is to fix: the doctor says so, or (no findings) any event after warm-up
        kind = "warning" if not found or any(f["severity"] != "info" for f in found) else "info"
    warm = ev[ev["warmup"]]
    if len(warm):
        first, last = warm["step"].min(), warm["step"].max()
        when = f"step {first}" if first == last else f"steps {first}–{last}"
        lines.append(f"{counted(len(warm), 'gradient-overflow event')} at {when}"
                     " happened during the scaler's warm-up: expected (it halves its initial scale until the"
                     " gradients fit), not a fault.")
    return kind, "  \n".join(lines)


def _gap_text(g: dict, what: str) -> str:
    where = f" of **{g['where']}**" if g.get("where") else ""
    phase = f" ({g['phase']})" if g.get("phase") else ""
    rel = f", {g['rel']:.2%} apart" if isinstance(g.get("rel"), float) and g["rel"] == g["rel"] \
        and g["rel"] != float("inf") else ""
    return f"{what}: {g['figure']}{where}{phase} at step {g['step']} ({g['a']} vs {g['b']}{rel})"


def diff_headline(d: dict) -> tuple[str, str]:
    """(st function name, text) for two compared runs: where they part first (ampwatch diff)."""
    a, b = d["a"]["name"], d["b"]["name"]
    tol = f"tolerance {d['rtol']:.2g} ({d['rtol_source']})"
    if not d["parted"]:
        return "success", (f"**{a}** and **{b}** do not part: every figure both recorded over "
                           f"{d['steps_shared']:,} shared steps agrees within {tol}.")
    lines = [f"**{a}** and **{b}** part at step **{d['parting_step']}** ({tol})."]
    if d["first_step"]:
        lines.append(_gap_text(d["first_step"][0], "First step figure"))
    if d["first_layer"]:
        lines.append(_gap_text(d["first_layer"], "First layer"))
    if d["first_module"]:
        lines.append(_gap_text(d["first_module"], "First module"))
    if d["settings"]:
        lines.append("Settings that differ: " + ", ".join(f"{s['field']} ({s['a']} vs {s['b']})"
                                                         for s in d["settings"][:6]))
    return "warning", "  \n".join(lines)
