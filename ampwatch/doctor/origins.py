"""Where an overflow or NaN was born, said in words, with the fix for that kind of origin."""
from __future__ import annotations

import math
from typing import Optional

import pandas as pd

from .finding import DTYPE_MAX, FP16_MAX, counted, num, times
from .facts import Facts

# A parameter of the origin's module whose norm grew 10x between two recorded steps is suspect:
# healthy runs change parameter norms by a few percent per recorded step. It was overwritten (a bad
# load, a corrupted update, an in-place bug) unless the optimizer's own updates reach that far (an
# SGD step of lr x a huge gradient does: then the updates blew it up, and the fix is the learning
# rate or clipping, not a checkpoint).
WEIGHT_JUMP = 10.0

# That ratio says nothing about a parameter that started at zero (a bias), nor about one outside the
# module where the overflow showed (a LayerNorm's bias feeding the next Linear). Adam-family
# optimizers bound how far any parameter can move: each element by its learning rate times a ratio
# of moment estimates a step (rarely above 1; at most ~7 with the default betas; Lion's is exactly
# 1; Adagrad's at most 1). So a norm that grew by more than TRAINING_MOVE_LIMIT x sqrt(numel) x the
# summed learning rates between two measurements (the triangle inequality: a norm grows by at most
# the distance moved) was not moved there by the optimizer, whatever it started from. The margin
# leaves room for other parameter groups' learning rates (the run records the first group's).
LR_BOUNDED_OPTIMIZERS = frozenset({
    "Adam", "AdamW", "NAdam", "RAdam", "Adamax", "Adagrad", "SparseAdam", "Lion", "FusedAdam",
    "Adam8bit", "AdamW8bit", "Adam32bit", "AdamW32bit", "PagedAdam", "PagedAdamW", "PagedAdamW8bit",
    "PagedAdamW32bit", "Lion8bit", "PagedLion"})
TRAINING_MOVE_LIMIT = 1000.0

# Optimizers whose update is the learning rate times the gradient (with momentum, times at most
# 1/(1 - momentum): within the same margin up to momentum 0.999): the recorded gradient norms bound
# how far they move a parameter (Facts.gradient_reach).
GRADIENT_BOUNDED_OPTIMIZERS = frozenset({"SGD", "ASGD"})

Jump = tuple[str, float, float, int, int, Optional[float]]


# Modules whose forward is a matrix product or a lookup: an fp16 overflow inside them (products or
# sums beyond 65504 become inf, and inf - inf in the next sum makes NaN) is the usual way they make
# NaN from finite inputs.
MATMUL_TYPES = ("Linear", "Bilinear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d",
                "ConvTranspose3d", "Conv1D", "MultiheadAttention")  # also subclasses named ...Linear
LOOKUP_TYPES = ("Embedding", "EmbeddingBag")


def is_matmul(cls: str) -> bool:
    return cls.endswith(MATMUL_TYPES) or cls in LOOKUP_TYPES


def undecided_nan_advice(facts: Facts, module: str, dtype: str) -> str:
    """Advice for NaN born in a forward without an fp32 verdict (none was recorded, or the recompute
    did not reproduce it): the cause is not known, so the candidates, overflow first for a matmul."""
    limit = num(DTYPE_MAX.get(dtype, FP16_MAX))
    fix = "keep it in fp32 or use bf16 autocast" if dtype == "float16" else "find what made its inputs or weights grow"
    overflow = (f"an overflow: a product or sum inside {module} beyond {dtype}'s {limit} becomes inf, and inf - inf "
                f"makes NaN ({fix})")
    op = "an operation that makes NaN from finite inputs (0/0, log or sqrt of a negative: guard it with an eps)"
    cls = facts.module_type(module) or ""
    if is_matmul(cls):
        return (f"Cause undetermined (no fp32 verdict for this step). {module} is a {cls}, so the likely cause is "
                f"{overflow}; check the size of its inputs and weights at this step. Otherwise: {op}")
    return f"Cause undetermined (no fp32 verdict for this step): either {overflow}, or {op}"


def place(module: str, phase: str) -> str:
    """``h.0.mlp.fc (forward)``, or ``the loss``."""
    return "the loss" if phase == "loss" else "the model's input batch" if phase == "input" else f"{module} ({phase})"


def describe_origins(origins: pd.DataFrame, limit: int = 3) -> str:
    parts = [f"{place(r.module, r.phase)} at {r.n:,} step{'s' if r.n != 1 else ''}"
             for r in origins.head(limit).itertuples()]
    return "; ".join(parts)


# The batch brought NaN/Inf in (the model's own input, phase "input"): no module and no precision is at fault.
INPUT_FIX = ("The data is the cause, not the model or its precision: find this batch in the data pipeline and fix or "
             "drop the sample (a missing value, a log of 0, a division by zero in preprocessing); a check such as "
             "torch.isfinite(x).all() in the loader keeps such batches out")


def fix_for_origin(module: str, phase: str) -> str:
    """Concrete advice for the module/phase where the overflow is born."""
    if phase == "forward":
        return (f"keep {module} in fp32: run it under torch.autocast(device_type, enabled=False) with its "
                f"input cast by .float(), or use bf16 autocast; or find what made its inputs or weights grow")
    if phase == "loss":
        return "compute the loss in fp32 (logits.float()) and guard logs/divisions with an eps"
    if phase == "input":
        return INPUT_FIX[0].lower() + INPUT_FIX[1:]
    if phase == "param_grad":
        return f"look at what feeds {module}'s gradient (its module's backward) and keep that module in fp32"
    return (f"the backward of {module} overflows: keep {module} in fp32, or guard the operation whose "
            f"derivative is unbounded (sqrt/pow/div at 0) with an eps")


def optimizer_reach(facts: Facts, name: str, first: int, last: int) -> Optional[float]:
    """How far the run's optimizer moves parameter ``name`` between norms measured before steps
    ``first`` and ``last``, before the TRAINING_MOVE_LIMIT margin: sqrt(numel) x the summed learning
    rates under an Adam-family optimizer, the summed learning rates x the largest gradient norm under
    SGD; None where the optimizer or the records do not bound it."""
    optimizer = str(facts.info.get("optimizer") or "")
    if optimizer in LR_BOUNDED_OPTIMIZERS:
        lr, numel = facts.lr_sum(first, last), facts.param_numel(name)
        return None if lr is None or not numel else math.sqrt(numel) * lr
    if optimizer in GRADIENT_BOUNDED_OPTIMIZERS:
        return facts.gradient_reach(first, last)
    return None


def _beyond(before: float, after: float, reach: Optional[float]) -> bool:
    """Whether a norm that went ``before`` -> ``after`` moved farther than training could
    (``reach``, None: not known, so no bound clears it)."""
    if reach is None:
        return True
    if not math.isfinite(after):  # only a non-finite update makes a weight non-finite
        return not math.isinf(reach)
    return after - before > TRAINING_MOVE_LIMIT * reach


def _module_jumps(facts: Facts, module: str, step: int, phase: str) -> list[Jump]:
    """The parameters of ``module`` (for a ``param_grad`` origin, the module that owns the
    parameter) whose norm jumped >= WEIGHT_JUMP x or became NaN/inf between their last two
    measurements up to ``step``, with how far the optimizer could have moved them (or None)."""
    if module in ("loss", "<model>"):
        return []
    if phase == "param_grad":  # the origin is a parameter's own gradient: look at its module
        module = module.rsplit(".", 1)[0] if "." in module else module
    norms = facts.last_param_norms(module + ".", step)
    jumps = []
    for name in sorted(norms):
        if len(norms[name]) >= 2:
            (s0, before), (s1, after) = norms[name]
            if before > 0 and math.isfinite(before) and not after < WEIGHT_JUMP * before:
                jumps.append((name, before, after, s0, s1, optimizer_reach(facts, name, s0, s1)))
    return jumps


def weight_jump(facts: Facts, module: str, step: int, phase: str = "") -> Optional[Jump]:
    """A parameter that did not get where it is by training, by ``step``: (name, norm before, norm
    after, step before, step after, how far the optimizer could have moved it or None), from the
    recorded parameter norms. First the parameters of ``module`` (for a ``param_grad`` origin, the
    module that owns the parameter): one whose norm jumped >= WEIGHT_JUMP x or became NaN/inf, farther
    than the optimizer reaches (:func:`optimizer_reach`; where that is not known, the jump alone).
    Then, where the run's optimizer bounds its steps by the learning rate (Adam and its kin), every
    parameter: the one whose norm grew the most beyond what the optimizer can move it
    (TRAINING_MOVE_LIMIT). Norms are measured before the optimizer step, so a NaN update at
    ``step`` does not count."""
    for jump in _module_jumps(facts, module, step, phase):
        if _beyond(jump[1], jump[2], jump[5]):
            return jump
    return _moved_beyond_training(facts, step)


def trained_jump(facts: Facts, module: str, step: int, phase: str = "") -> Optional[Jump]:
    """A parameter of ``module`` whose norm jumped >= WEIGHT_JUMP x by ``step`` within what the
    optimizer's updates reach: the updates themselves blew it up (too high a learning rate, an
    unclipped huge gradient)."""
    return next((j for j in _module_jumps(facts, module, step, phase) if not _beyond(j[1], j[2], j[5])), None)


def _moved_beyond_training(facts: Facts, step: int) -> Optional[Jump]:
    if str(facts.info.get("optimizer") or "") not in LR_BOUNDED_OPTIMIZERS:
        return None
    best, best_excess = None, 1.0
    lr_sums: dict[tuple[int, int], Optional[float]] = {}
    for name, rows in sorted(facts.last_param_norms("", step).items()):
        if len(rows) < 2:
            continue
        (s0, before), (s1, after) = rows
        # a growth of under 1% is no sign of anything, at any learning rate
        if not (math.isfinite(before) and math.isfinite(after)) or after <= 1.01 * before:
            continue
        if (s0, s1) not in lr_sums:
            lr_sums[s0, s1] = facts.lr_sum(s0, s1)
        lr, numel = lr_sums[s0, s1], facts.param_numel(name)
        if lr is None or not numel:
            continue
        reach = math.sqrt(numel) * lr  # how far the optimizer moves it, at about lr per element a step
        excess = (after - before) / (TRAINING_MOVE_LIMIT * reach) if reach > 0 else math.inf
        if excess > best_excess:
            best, best_excess = (name, before, after, s0, s1, reach), excess
    return best


def overwritten_around(facts: Facts, step: int) -> Optional[Jump]:
    """A parameter moved beyond what training moves it (Adam-family runs) between the last norm
    measurement before ``step`` and the first at or after it: a weight overwritten around an event at
    ``step`` that measured no norms itself (a loss spike)."""
    at = facts.next_detail_step(step)
    if at is None:
        return None
    jumped = _moved_beyond_training(facts, at)
    return jumped if jumped is not None and jumped[3] < step <= jumped[4] else None


def jump_text(jump: Jump, optimizer: str = "the optimizer") -> str:
    """The evidence for a weight's jump: its norms, and how far the optimizer could have moved it."""
    name, before, after, s0, s1, reach = jump
    norms = f"{num(before)} -> {num(after)}"
    if not math.isfinite(after):
        return f"the weights of {name} became non-finite between steps {s0:,} and {s1:,} (norm {norms})"
    if before > 0 and after >= WEIGHT_JUMP * before:
        went = f"the norm of {name} jumped {times(after / before)} between steps {s0:,} and {s1:,} ({norms})"
    else:
        went = f"the norm of {name} went from {num(before)} to {num(after)} between steps {s0:,} and {s1:,}"
    if reach is None:
        return went
    if reach == 0:
        return f"{went}, with a learning rate of 0 all that time"
    recorded = ("learning rates and gradient norms" if optimizer in GRADIENT_BOUNDED_OPTIMIZERS
                else "learning rates")
    moves = f"{optimizer} moves it in {counted(s1 - s0, 'step')} at the recorded {recorded} (about {num(reach)})"
    if after - before > reach:
        return f"{went}, {(after - before) / reach:,.0f}x as far as {moves}"
    return f"{went}: no farther than {moves}"


def restore_text(facts: Facts, jump: Jump, step: int) -> str:
    """Which checkpoint holds the weight before it was overwritten, and what that bound rests on."""
    name, _, _, s0, _, _ = jump
    good = facts.last_good_step(step)
    measured = f"its norm was last measured normal at step {s0:,}"
    if good is None or good <= s0:
        return f"Restore it from a checkpoint saved at step {s0:,} or before ({measured})"
    return (f"Restore it from a checkpoint saved by the end of step {good:,} (the last step before step {step:,} "
            f"with a finite loss and an applied update; {measured})")


def overwrite_advice(facts: Facts, jumped: Jump,
                     step: int) -> tuple[str, str]:
    """(extra evidence, advice) for a parameter :func:`weight_jump` found overwritten by ``step``."""
    return (f"; {jump_text(jumped, str(facts.info.get('optimizer') or 'the optimizer'))}",
            f"{jumped[0]} changed far more than training moves weights: something overwrote it (a bad "
            f"checkpoint load, an in-place bug, a corrupted update). {restore_text(facts, jumped, step)} "
            f"and find what wrote it")


def origin_advice(facts: Facts, module: str, phase: str, step: int, kind: str = "inf",
                  dtype: str = "float16") -> tuple[str, str]:
    """(extra evidence, advice) for an overflow born in ``module``/``phase`` at ``step``: an
    overwritten weight if the recorded norms show one, else the fix for that kind of origin (for NaN
    born in a forward, the candidates: without an fp32 verdict its cause is not known)."""
    jumped = weight_jump(facts, module, step, phase)
    if jumped:
        return overwrite_advice(facts, jumped, step)
    extra, advice = _origin_fix(facts, module, phase, step, kind, dtype)
    grown = trained_jump(facts, module, step, phase)
    if grown is None:
        return extra, advice
    unscale = ", after scaler.unscale_(optimizer)" if facts.info.get("scaler_enabled") else ""
    if math.isfinite(grown[2]):
        first = (f"The optimizer's own updates blew {grown[0]} up: lower the learning rate, or clip the gradients "
                 f"(torch.nn.utils.clip_grad_norm_{unscale}) so that one huge gradient cannot move it that far")
    else:  # an applied update with a non-finite gradient: clipping keeps NaN, a lower rate too
        first = (f"An update with a non-finite gradient made {grown[0]} non-finite: skip such steps (a GradScaler "
                 f"does; or step only when torch.isfinite(total_norm), the norm clip_grad_norm_ returns)")
    return (f"{extra}; {jump_text(grown, str(facts.info.get('optimizer') or 'the optimizer'))}",
            f"{first}. Then: {advice[0].lower()}{advice[1:]}")


def _forward_went_bad(facts: Facts, step: int) -> bool:
    """Whether any module's forward value (or the model's input) was non-finite at ``step``."""
    ev = facts.events
    return bool(len(ev)) and bool(((ev["step"] == step) & ev["phase"].isin(["forward", "input"])).any())


def _outputs_gone(facts: Facts, step: int) -> bool:
    """Whether the replay of ``step`` could not ask the step's own outputs (notice replay-outputs-gone)."""
    n = facts.notices
    return bool(len(n)) and bool(((n["code"] == "replay-outputs-gone") & (n["step"] == step)).any())


def _origin_fix(facts: Facts, module: str, phase: str, step: int, kind: str, dtype: str) -> tuple[str, str]:
    why = facts.unlocalized(step) if phase == "loss" else None
    if why is not None and not facts.info.get("localize"):
        return "", ("Recorded with localize=False, so the loss is the first place this run sees it: record with "
                    "localize=True to find the module where it is born, and compute the loss in fp32")
    if why is not None:
        return (f"; step {step:,} was not localized: {why}",
                f"Where it was born is unknown: step {step:,} was not localized, so the loss is only the "
                f"first place this run sees it, not evidence that the loss computation is at fault. "
                + ("Later bad steps are localized live (module values are measured on every step after it); to "
                   "observe every step from the start, attach with replay=False" if "replay" in why else
                   "If it recurs, a localized bad step (one with module values) names the place"))
    if phase == "loss" and why is None and not _forward_went_bad(facts, step) and _outputs_gone(facts, step):
        return (f"; replayed on the same weights and inputs, the model's outputs came out finite (notice "
                f"replay-outputs-gone: the step's own outputs were gone), so most likely it was made after the "
                f"model, by the loss computation or by its targets; a fault of step {step:,}'s forward that did "
                f"not recur is not ruled out",
                f"Check the targets (labels) of step {step:,} for NaN/inf: torch.isfinite(y).all() in the loader "
                f"keeps such samples out; and compute the loss in fp32 (logits.float()) with logs and divisions "
                f"guarded by an eps. If the targets are finite, run the step again from its saved inputs: a "
                f"fault that does not recur points at the device")
    if phase == "loss" and why is None and not _forward_went_bad(facts, step):
        return (f"; the model's outputs were finite at step {step:,} (its module values were recorded), so it was "
                f"made after the model: by the loss computation or by its targets",
                f"Check the targets (labels) of step {step:,} for NaN/inf: torch.isfinite(y).all() in the loader "
                f"keeps such samples out; and compute the loss in fp32 (logits.float()) with logs and divisions "
                f"guarded by an eps")
    if phase == "forward" and "nan" in str(kind):  # NaN, or NaN and inf
        return "", undecided_nan_advice(facts, module, dtype)
    advice = fix_for_origin(module, phase)
    return "", advice[0].upper() + advice[1:]
