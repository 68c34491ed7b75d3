"""Rules about fp8 layers (torchao ``Float8Linear``): casts that lose a large share of their values,
and layers whose fp8 output is far less accurate than their peers'. Read from ``fp8_layers``
(recorded on ``layer_every`` steps, docs/fp8.md)."""
from __future__ import annotations

import math

import pandas as pd

from .facts import Facts
from .finding import Finding, num, span

# A cast that flushes 10% or more of a tensor's nonzero values to zero. Healthy fp8 casts flush
# almost nothing: dynamic scaling puts the amax at the fp8 maximum and e4m3 (e5m2) still holds
# values 2^-17 (2^-32) below it, so only values a ~10^5 (~10^9) times smaller than the amax vanish
# (measured on healthy MLP and GPT runs, tests/test_fp8.py: < 0.1%). Losing a tenth of a tensor takes an
# outlier that sets the scale for everything else.
FLUSH_WARN = 0.10
# A layer whose fp8 output error (mean over recorded steps) is 3x its peers' median and at least
# 10%. Healthy layers sit at 2-6% (e4m3's 3 mantissa bits, averaged over the matmul's sums), all alike.
ERR_FACTOR = 3.0
ERR_MIN = 0.10
_NAMES_SHOWN = 4


def _filter_advice(modules: list[str]) -> str:
    names = ", ".join(repr(m) for m in modules)
    return (f"convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: fqn not in {{{names}}}) "
            f"keeps {'this layer' if len(modules) == 1 else 'these layers'} in bf16")


def fp8_cast_loss(facts: Facts) -> list[Finding]:
    """Warning: an fp8 cast flushes a large share of a tensor's nonzero values to zero."""
    if not facts.info.get("fp8_layers") or not facts.has_table("fp8_layers"):
        return []
    hits = facts.ask(
        "SELECT module, role, dtype, scaling, MIN(step) AS first, MAX(step) AS last, COUNT(*) AS n,"
        " MAX(flush_frac) AS worst FROM fp8_layers WHERE role != 'output' AND flush_frac >= ?"
        " GROUP BY module, role ORDER BY worst DESC", (FLUSH_WARN,))
    if not len(hits):
        return []
    lines = []
    for h in hits.itertuples():
        at = facts.ask("SELECT step, amax, p99, flush_frac FROM fp8_layers WHERE module = ? AND role = ?"
                       " AND flush_frac = ? ORDER BY step LIMIT 1", (h.module, h.role, h.worst)).iloc[0]
        ratio = at["amax"] / at["p99"] if at["p99"] and at["p99"] > 0 else math.nan
        recorded = int(facts.ask("SELECT COUNT(*) AS n FROM fp8_layers WHERE module = ? AND role = ? AND step >= ?",
                                 (h.module, h.role, int(h.first)))["n"].iloc[0])
        lines.append(f"{h.module} {h.role} ({h.dtype} {h.scaling}): up to {100 * h.worst:.0f}% of nonzero values "
                     f"flushed to zero (step {int(at['step']):,}: amax {num(at['amax'])}, p99 {num(at['p99'])}, "
                     f"outlier ratio amax/p99 {num(ratio)}), on {int(h.n)} of {recorded} recorded steps "
                     f"from step {int(h.first):,}")
    modules = list(dict.fromkeys(hits["module"]))
    first, last = int(hits["first"].min()), int(hits["last"].max())
    top = hits.iloc[0]
    errors = _output_errors(facts)
    err = errors.get(top["module"])
    if err is not None:
        lines.append(f"{top['module']} fp8 output error {100 * err:.1f}% (mean over recorded steps; peers' median "
                     f"{100 * _median([e for m, e in errors.items() if m != top['module']]):.1f}%)")
    tensorwise = (hits["scaling"] == "tensorwise").any()
    advice = (("Use rowwise scaling (convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name"
               "('rowwise'))): one outlier then sets the scale of its own row only; or " if tensorwise else
               "Rowwise scaling is already in use and still loses them: ") + _filter_advice(modules)
              + ". Outliers this large are also worth finding at their source (the layer before).")
    more = f" (+{len(lines) - _NAMES_SHOWN} more)" if len(lines) > _NAMES_SHOWN else ""
    title = (f"fp8 cast of {top['module']} {top['role']} flushes {100 * top['worst']:.0f}% of its nonzero values "
             f"to zero ({span(first, last)})")
    return [facts.finding("fp8-cast-loss", "warning", title, first, last,
                          "; ".join(lines[:_NAMES_SHOWN]) + more, advice)]


def fp8_output_error(facts: Facts) -> list[Finding]:
    """Warning: an fp8 layer's output error is far above its peers' (and not explained by a lossy cast,
    which :func:`fp8_cast_loss` reports with that error)."""
    if not facts.info.get("fp8_layers") or not facts.has_table("fp8_layers"):
        return []
    errors = _output_errors(facts)
    if len(errors) < 2:
        return []
    lossy = set(facts.ask("SELECT DISTINCT module FROM fp8_layers WHERE role != 'output' AND flush_frac >= ?",
                          (FLUSH_WARN,))["module"])
    bad = []
    for module, err in errors.items():
        peers = _median([e for m, e in errors.items() if m != module])
        if module not in lossy and err >= ERR_MIN and err >= ERR_FACTOR * peers:
            bad.append((module, err, peers))
    if not bad:
        return []
    bad.sort(key=lambda b: -b[1])
    steps = facts.ask("SELECT MIN(step) AS first, MAX(step) AS last FROM fp8_layers WHERE role = 'output'").iloc[0]
    evidence = "; ".join(f"{m}: fp8 output {100 * e:.1f}% off the same layer in high precision (mean over "
                         f"recorded steps), peers' median {100 * p:.1f}%" for m, e, p in bad[:_NAMES_SHOWN])
    return [facts.finding("fp8-output-error", "warning",
                          f"fp8 layer {bad[0][0]} is {bad[0][1] / max(bad[0][2], 1e-12):.0f}x less accurate than its "
                          f"peers", int(steps["first"]), int(steps["last"]), evidence,
                          "Keep it in bf16: " + _filter_advice([b[0] for b in bad]) + ".")]


def _output_errors(facts: Facts) -> dict[str, float]:
    df: pd.DataFrame = facts.ask("SELECT module, AVG(rel_err) AS err FROM fp8_layers WHERE role = 'output'"
                                 " AND rel_err IS NOT NULL GROUP BY module")
    return dict(zip(df["module"], df["err"].astype(float)))


def _median(values: list[float]) -> float:
    return float(pd.Series(values, dtype=float).median()) if values else math.nan
