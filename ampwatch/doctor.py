"""The doctor: a recorded run in, findings with evidence and a concrete fix out (issue 5).

Pure: reads only the :class:`ampwatch.Run` it is given (no torch, no I/O of its own). The rules
themselves, and the thresholds with their justification, live in :mod:`ampwatch.rules`.

>>> for f in ampwatch.diagnose("sample_runs/diverged.sqlite"):
...     print(f.severity, f.title)
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any, Callable, Optional

import numpy as np
import pandas as pd

SEVERITIES = ("error", "warning", "info")

FP16_MAX = 65504.0

# Warm-up: GradScaler starts at init_scale (2**16 by default; people pass 2**24) and halves on each
# overflow until it fits, so a healthy run skips a handful of steps at the start, close together,
# before the scale has ever grown. The first must come early and the gaps stay short: the gradients
# have barely changed yet. 50/25 steps covers every warm-up in our runs (gaps of 1-5 steps) with
# room for models whose gradients grow over the first steps.
WARMUP_FIRST_STEP = 50
WARMUP_MAX_GAP = 25

# A diverged tail: NaN/inf loss on the last 3+ steps (one or two are an overflow the scaler may
# still fix). Health rules judge only the steps before it; the divergence finding covers the rest.
NAN_TAIL_MIN = 3


@dataclass(frozen=True)
class Finding:
    """One thing the doctor noticed about a run.

    :param id: stable identifier, e.g. ``scale-collapse`` (see docs/doctor.md for the list).
    :param severity: ``'error'``, ``'warning'`` or ``'info'``.
    :param title: one line.
    :param steps: ``(first, last)`` step the finding concerns.
    :param evidence: the numbers that triggered it.
    :param advice: what to change, concretely.
    :param jump: ``(start, end)`` step range for a UI to show.
    """
    id: str
    severity: str
    title: str
    steps: tuple[int, int]
    evidence: str
    advice: str
    jump: tuple[int, int]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["steps"], d["jump"] = list(self.steps), list(self.jump)
        return d


def sort_findings(findings: list[Finding]) -> list[Finding]:
    """Errors first, then warnings, then info; within a severity by first step (stable otherwise)."""
    return sorted(findings, key=lambda f: (SEVERITIES.index(f.severity), f.steps[0]))


# -- formatting helpers -----------------------------------------------------------------------------

def num(x: Any) -> str:
    """1,234 for integers, 3 significant digits otherwise, 2^k for exact powers of two as a hint."""
    if x is None:
        return "n/a"
    x = float(x)
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    text = f"{int(x):,}" if x.is_integer() and abs(x) < 1e15 else f"{x:.3g}"
    if x > 0:
        k = math.log2(x)
        if k.is_integer() and abs(k) >= 4:
            text += f" (2^{int(k)})"
    return text


def pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "n/a"


def span(first: int, last: int) -> str:
    return f"step {first:,}" if first == last else f"steps {first:,}-{last:,}"


# -- the facts every rule shares ------------------------------------------------------------------

@dataclass
class Warmup:
    first: int
    last: int
    skips: list[int]
    scale_from: float
    scale_to: float


class Facts:
    """A run's tables plus what several rules need: warm-up, diverged tail, healthy range."""

    def __init__(self, info: dict, steps: pd.DataFrame, tables: Callable[[str], pd.DataFrame],
                 loss_logged: Optional[bool] = None) -> None:
        self.info = info
        self.steps = steps.reset_index(drop=True)
        self._tables = tables
        self.first_step = int(steps["step"].min()) if len(steps) else 0
        self.last_step = int(steps["step"].max()) if len(steps) else 0
        self.fp16 = info.get("amp_dtype") == "float16"
        self.scaling = bool(info.get("scaler_enabled")) and self.steps["loss_scale"].notna().any()
        loss = self.steps["loss"].astype(float)
        # The reader shows NaN and "not logged" alike; an all-missing column is "not logged" unless
        # the file's NaN bits say otherwise (a run that was NaN from its first step).
        self.has_loss = bool(loss.notna().any()) if loss_logged is None else loss_logged
        self.nan_tail_start = self._nan_tail_start()
        self.healthy_end = self.last_step if self.nan_tail_start is None else self.nan_tail_start - 1
        self.warmup = self._warmup()

    @classmethod
    def of(cls, run: Any) -> "Facts":
        logged = None
        if hasattr(run, "query"):
            logged = bool(run.query("SELECT COUNT(*) AS n FROM steps WHERE loss IS NOT NULL"
                                    " OR (nan_mask & 1) != 0")["n"].iloc[0])
        return cls(run.info, run.steps, lambda name: getattr(run, name), logged)

    def table(self, name: str) -> pd.DataFrame:
        return self._tables(name)

    @cached_property
    def events(self) -> pd.DataFrame:
        return self.table("events")

    @cached_property
    def tensors(self) -> pd.DataFrame:
        return self.table("tensors")

    @cached_property
    def layers(self) -> pd.DataFrame:
        return self.table("layers")

    @cached_property
    def modules(self) -> pd.DataFrame:
        return self.table("modules")

    @cached_property
    def metrics(self) -> pd.DataFrame:
        return self.table("metrics")

    @cached_property
    def notices(self) -> pd.DataFrame:
        return self.table("notices")

    @cached_property
    def _scale(self) -> pd.Series:
        return self.steps.set_index("step")["loss_scale"].astype(float)

    def module_type(self, name: str) -> Optional[str]:
        """The class of module ``name`` (e.g. ``Linear``), when the run recorded it."""
        t = self.tensors
        row = t[(t["kind"] == "module") & (t["name"] == name)] if len(t) else t
        return row["type"].iloc[0] if len(row) and isinstance(row["type"].iloc[0], str) else None

    def module_label(self, name: str) -> str:
        """``h.0.mlp.fc (Linear)``: the name with its class, when the run recorded it."""
        kind = self.module_type(name)
        return f"{name} ({kind})" if kind else name

    def jump(self, first: int, last: int, pad: int = 10) -> tuple[int, int]:
        return max(self.first_step, first - pad), min(self.last_step, last + pad)

    def scale_at(self) -> pd.Series:
        """The loss scale each step's gradients carried, indexed by step."""
        return self._scale

    def after_warmup(self) -> pd.DataFrame:
        """Steps after the warm-up and before a diverged tail: where health is judged."""
        start = self.warmup.last + 1 if self.warmup else self.first_step
        s = self.steps
        return s[(s["step"] >= start) & (s["step"] <= self.healthy_end)]

    def _nan_tail_start(self) -> Optional[int]:
        if not self.has_loss:
            return None
        finite = np.isfinite(self.steps["loss"].astype(float).to_numpy())
        n_bad = len(finite) - (int(np.flatnonzero(finite).max()) + 1 if finite.any() else 0)
        if n_bad < NAN_TAIL_MIN:
            return None
        return int(self.steps["step"].iloc[len(finite) - n_bad])

    def _warmup(self) -> Optional[Warmup]:
        if not self.scaling:
            return None
        s = self.steps
        scale = s["loss_scale"].astype(float).to_numpy()
        skipped_idx = np.flatnonzero(s["skipped"].to_numpy())
        ev = self.events
        bad_fwd = set(ev.loc[ev["phase"].isin(["forward", "loss"]), "step"]) if len(ev) else set()
        taken: list[int] = []
        for i in skipped_idx:
            step = int(s["step"].iloc[i])
            prev = int(s["step"].iloc[taken[-1]]) if taken else self.first_step
            grew = bool(np.any(np.diff(scale[: i + 1]) > 0))
            if (step - prev > (WARMUP_FIRST_STEP if not taken else WARMUP_MAX_GAP) or grew
                    or step in bad_fwd or not scale[i] >= 1.0 or step > self.healthy_end):
                break
            taken.append(int(i))
        if not taken:
            return None
        steps = [int(s["step"].iloc[i]) for i in taken]
        after = scale[taken[-1] + 1] if taken[-1] + 1 < len(scale) else scale[taken[-1]] / 2
        if not after < scale[0]:  # a warm-up is the scale backing off; without a drop it is something else
            return None
        return Warmup(self.first_step, steps[-1], steps, float(scale[0]), float(after))

    def origins(self, steps: Any) -> pd.DataFrame:
        """Where the non-finite values at ``steps`` were born, per (module, phase), most frequent first.

        A non-finite loss counts only on steps without a module origin (it is usually their effect);
        without localization, the parameters with non-finite gradients stand in."""
        ev = self.events
        if not len(ev):
            return pd.DataFrame(columns=["module", "phase", "n", "first"])
        ev = ev[ev["step"].isin(set(steps))]
        born = ev[ev["origin"]]
        loss = ev[(ev["phase"] == "loss") & ~ev["step"].isin(set(born["step"]))]
        picked = pd.concat([born, loss]) if len(loss) else born
        if not len(picked):
            picked = ev[ev["phase"] == "param_grad"]
        g = picked.groupby(["module", "phase"])["step"].agg(n="nunique", first="min").reset_index()
        return g.sort_values(["n", "first"], ascending=[False, True]).reset_index(drop=True)


def place(module: str, phase: str) -> str:
    """``h.0.mlp.fc (forward)``, or ``the loss``."""
    return "the loss" if phase == "loss" else f"{module} ({phase})"


def describe_origins(origins: pd.DataFrame, limit: int = 3) -> str:
    parts = [f"{place(r.module, r.phase)} at {r.n:,} step{'s' if r.n != 1 else ''}"
             for r in origins.head(limit).itertuples()]
    return "; ".join(parts)


def fix_for_origin(module: str, phase: str) -> str:
    """Concrete advice for the module/phase where the overflow is born."""
    if phase == "forward":
        return (f"keep {module} in fp32: run it under torch.autocast(device_type, enabled=False) with its "
                f"input cast by .float(), or use bf16 autocast; or find what made its inputs or weights grow")
    if phase == "loss":
        return "compute the loss in fp32 (logits.float()) and guard logs/divisions with an eps"
    if phase == "param_grad":
        return f"look at what feeds {module}'s gradient (its module's backward) and keep that module in fp32"
    return (f"the backward of {module} overflows: keep {module} in fp32, or guard the operation whose "
            f"derivative is unbounded (sqrt/pow/div at 0) with an eps")



def diagnose(run: Any) -> list[Finding]:
    """Findings for a :class:`ampwatch.Run`, most severe first, then by step.

    :param run: an opened run (finished or still being written).

    Reads the run's tables once; cost grows with the number of recorded rows, not with the model.
    """
    from .rules import RULES
    facts = Facts.of(run)
    findings: list[Finding] = []
    for rule in RULES:
        findings.extend(rule(facts))
    return sort_findings(findings)


def _wrap(label: str, text: str, width: int = 100) -> list[str]:
    import textwrap
    pad = " " * (2 + len(label))
    return textwrap.wrap(text, width=width, initial_indent=f"  {label}", subsequent_indent=pad) or [f"  {label}"]


def format_report(run: Any, findings: list[Finding]) -> str:
    """A plain-text report: a header line for the run, then one block per finding."""
    info = run.info
    n = len(run.steps)
    scaler = "GradScaler on" if info.get("scaler_enabled") else "no GradScaler"
    counts = {s: sum(f.severity == s for f in findings) for s in SEVERITIES}
    lines = [f"{run.name}  ({run.path})",
             f"{n:,} steps, {info.get('amp_dtype') or 'no autocast seen'}, {scaler}, {info.get('status')}",
             f"{counts['error']} error(s), {counts['warning']} warning(s), {counts['info']} info"]
    if not findings:
        lines.append("")
        lines.append("No findings: nothing in this run needs attention.")
    for f in findings:
        first, last = f.steps
        where = f"step {first:,}" if first == last else f"steps {first:,}-{last:,}"
        lines.append("")
        lines.append(f"{f.severity.upper():<8}{f.id}  ({where})")
        lines.extend(_wrap("", f.title))
        lines.extend(_wrap("evidence: ", f.evidence))
        lines.extend(_wrap("advice:   ", f.advice))
    return "\n".join(lines)


__all__ = ["Finding", "diagnose", "format_report", "sort_findings", "SEVERITIES"]
