"""``ampwatch diff`` as text: the two runs, the tolerance, the settings that differ, where the runs
part (the step, the layer, the module) and the largest differences on the steps they share."""
from __future__ import annotations

import math
from typing import Any, Optional

from ..doctor.diff import MANTISSA_BITS, RTOL_CAP, RTOL_FLOOR, ULPS, Gap, RunDiff
from ..doctor.finding import counted

FIGURE_NAMES = {"loss": "loss", "grad_norm": "gradient norm", "loss_scale": "loss scale", "skipped": "skipped",
                "param_norm": "parameter norm", "amax": "max |value|"}


def num(x: Any) -> str:
    """A recorded value, short: 4 significant digits, NaN/inf spelled out, None as '-'."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return str(x) if not math.isfinite(x) else f"{x:.4g}"
    return str(x)


def apart(g: Gap) -> str:
    """How far apart, in words: a percentage (of what), and b/a."""
    if g.rel is None:
        return ""
    if not math.isfinite(g.rel):
        return "finite in one run only" if _finite(g.a) or _finite(g.b) else "non-finite differently"
    of = "of the step's gradient norm" if g.table == "layers" and g.figure == "grad_norm" else "apart"
    ratio = f", b/a {g.ratio:.4g}" if g.ratio is not None else ""
    return f"{pct(g.rel)} {of}{ratio}"


def pct(rel: float) -> str:
    """0.0476 -> '4.8%', 0.99999 -> '100%'."""
    v = rel * 100
    return f"{v:.0f}%" if v >= 10 else f"{v:.2g}%"


def gap_line(g: Gap, label: bool = True) -> str:
    """``at step 10: 2.weight parameter norm  a 3.35  b 3.517  (4.8% apart, b/a 1.05)``"""
    where = f"{g.where} ({g.phase}) " if g.phase else (f"{g.where} " if g.where else "")
    text = f"{where}{FIGURE_NAMES.get(g.figure, g.figure)}  a {num(g.a)}  b {num(g.b)}"
    how = apart(g)
    text += f"  ({how})" if how else ""
    return f"at step {g.step}: {text}" if label else text


def format_diff(d: RunDiff) -> str:
    """The plain-text report of :func:`ampwatch.doctor.diff.diff_runs`'s result."""
    lines = [f"a  {d.names[0]}  ({d.paths[0]})", f"b  {d.names[1]}  ({d.paths[1]})", ""]
    lines += _tolerance(d) + _coverage(d) + [""] + _settings(d) + [""]
    if d.parted:
        lines.append(f"THE RUNS PART AT STEP {d.parting_step}")
        lines += _partings(d)
    else:
        lines.append("NO PARTING: every compared figure agrees within the tolerance on the steps both runs recorded")
    lines += [""] + _largest(d)
    return "\n".join(lines)


def _tolerance(d: RunDiff) -> list[str]:
    units = ULPS * 2.0 ** -MANTISSA_BITS.get(d.rtol_source, MANTISSA_BITS["bfloat16"])
    if d.rtol_source == "given":
        source = "as given"
    elif units < RTOL_FLOOR:
        source = f"the floor for {d.rtol_source} runs; --rtol to change"
    elif units > RTOL_CAP:
        source = f"the cap, {d.rtol_source} being the coarser dtype; --rtol to change"
    else:
        source = f"ten units in the last place of {d.rtol_source}, the coarser dtype; --rtol to change"
    return [f"tolerance  {d.rtol:.3g} relative ({source})",
            "           skipped steps and the loss scale exactly; a difference parts when it is still beyond",
            "           the tolerance at the next step both runs recorded, or is finite in one run only"]


def _coverage(d: RunDiff) -> list[str]:
    lines = [f"compared   {d.steps_shared} shared steps; layers on {d.detail_steps.get('layers', 0)} of them, "
             f"modules on {d.detail_steps.get('modules', 0)}"]
    for side, (count, first, last) in zip("ab", d.steps_only):
        if count:
            lines.append(f"           {counted(count, 'step')} only in {side} ({first}-{last}): not compared")
    for table, (only_a, only_b) in d.names_only.items():
        if only_a or only_b:
            how = ("compared on the names both have" if d.detail_steps.get(table, 0)
                   else "none compared: no name in both runs on a step both recorded it")
            lines.append(f"           {table}: {only_a} only in a, {only_b} only in b ({how})")
    for fig in d.not_compared:
        lines.append(f"           {FIGURE_NAMES.get(fig, fig)} not compared: one run never recorded it")
    return lines


def _settings(d: RunDiff) -> list[str]:
    if not d.settings:
        return ["settings   the same (dtype, scaler, optimizer, torch, device, config ...)"]
    width = max(len(f) for f, _, _ in d.settings)
    lines = ["settings that differ"]
    lines += [f"  {f:<{width}}  a {num(a):<18} b {num(b)}" for f, a, b in d.settings]
    return lines


def _partings(d: RunDiff) -> list[str]:
    lines = []
    if d.first_step:
        lines.append(f"  steps    {_joined(d.first_step)}")
    else:
        lines.append("  steps    loss, gradient norm, skipped steps and loss scale agree on every shared step")
    lines.append(f"  layer    {_detail(d.first_layer, 'layer', d.detail_steps.get('layers', 0))}")
    lines.append(f"  module   {_detail(d.first_module, 'module', d.detail_steps.get('modules', 0))}")
    return lines


def _joined(gaps: list[Gap]) -> str:
    return f"at step {gaps[0].step}: " + "; ".join(gap_line(g, label=False) for g in gaps)


def _detail(g: Optional[Gap], what: str, compared_steps: int) -> str:
    if g is None and not compared_steps:  # "no layer parts" would read as "the layers agree"
        return f"not compared: no {what} recorded under the same name on a step both runs recorded"
    if g is None:
        return f"no {what} parts on the steps both runs recorded {what}s"
    more = (f"; {counted(g.others, 'more ' + what)} {'parts' if g.others == 1 else 'part'} at that step"
            if g.others else "")
    return gap_line(g) + more


def _largest(d: RunDiff) -> list[str]:
    if not d.largest:
        return ["largest differences: none; every compared figure is identical on the shared steps"]
    lines = ["largest differences on the shared steps"]
    for g in d.largest:
        lines.append(f"  {g.table:<8} {gap_line(g)}")
    return lines


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


__all__ = ["format_diff", "gap_line", "apart", "num", "pct"]
