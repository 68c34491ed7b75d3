"""Rules about fp16's range: gradients underflowing to zero, activations near 65504, and where
NaN/Inf was born."""
from __future__ import annotations

from typing import Optional

import numpy as np
import pandas as pd

from .finding import DTYPE_MAX, FP16_MAX, Finding, counted, num, span
from .facts import Facts
from .origins import INPUT_FIX, origin_advice

# Gradient underflow: a row is "at low scale" when its largest scaled gradient element is below 1:
# fp16 has only 24 binary orders of magnitude below 1 before flushing to zero, and a gradient's
# elements spread over many orders below their maximum. Healthy fp16 runs at a normal scale have
# <1% exactly-zero elements apart from structural zeros (dead ReLU units, unused embedding rows),
# which we subtract: the same parameter's zero fraction at normal scale. 20 percentage points more
# zeros, and at least a quarter of the tensor, is a fifth of the gradient signal gone.
UNDERFLOW_SCALED_AMAX = 1.0
UNDERFLOW_EXCESS = 0.20
UNDERFLOW_MIN_FRAC = 0.25

# Activation headroom: fp16 activations within 4x of 65504 (the "factor of 2-4") on at
# least 3 recorded detail rows in a row (3 x layer_every steps by default): one larger batch or a
# little weight growth away from inf. Healthy runs sit orders of magnitude below (max ~10-1000).
HEADROOM_FACTOR = 4.0
HEADROOM_MIN_ROWS = 3

# Modules that compute in fp32 under autocast, so their outputs are not fp16 activations.
FP32_MODULE_TYPES = {"LayerNorm", "GroupNorm", "RMSNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d",
                     "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d", "Softmax", "LogSoftmax",
                     "Embedding", "EmbeddingBag", "CrossEntropyLoss", "MSELoss", "NLLLoss"}


def _scaled_amax(facts: Facts, rows: pd.DataFrame) -> np.ndarray:
    """Each row's largest gradient element as the scaler left it (a step without a scale: unscaled)."""
    scale = facts.scales(rows["step"].to_numpy()) if facts.scaling else np.ones(len(rows))
    return rows["grad_amax"].to_numpy(dtype=float) * np.where(np.isnan(scale), 1.0, scale)


def _judged_amax(rows: pd.DataFrame) -> pd.DataFrame:
    """``rows`` (one parameter's, in step order) with each all-zero gradient (max 0) given the
    parameter's nearest nonzero maximum, the last before it, else the first after.

    A gradient that is zero everywhere has no maximum left to show whether the scale was too low to
    hold it or its units stopped receiving gradient (ReLUs that died after too large a step). If its
    last measured size, at this step's scale, would still reach 1, flushing all of it would have
    taken a 2**24-fold shrink in one detail interval: those zeros are not the scale's doing.
    A parameter never seen nonzero keeps 0 (it counts as low scale, as before)."""
    amax = rows["grad_amax"].where(rows["grad_amax"] > 0)
    return rows.assign(grad_amax=amax.ffill().bfill().fillna(0.0))


def grad_underflow(facts: Facts) -> list[Finding]:
    """Warning: many more exactly-zero gradient elements at low scale than at normal scale."""
    if not facts.fp16:
        return []
    t = facts.tensors
    trainable = set(t.loc[(t["kind"] == "param") & (t["trainable"].fillna(1) == 1), "name"])
    first = facts.warmup.last + 1 if facts.warmup else None
    # A parameter's low-scale median reaches UNDERFLOW_MIN_FRAC only if one of its low-scale rows
    # does: find those few rows first, then read the whole history of just those parameters.
    rows = facts.measured_grads(first, facts.healthy_end, trainable, min_zero_frac=UNDERFLOW_MIN_FRAC)
    suspects = set(rows.loc[_scaled_amax(facts, rows) < UNDERFLOW_SCALED_AMAX, "name"])
    if not suspects:
        return []
    rows = facts.measured_grads(first, facts.healthy_end, suspects)
    hits = []
    for name, g in rows.groupby("name", sort=False):
        g = g.assign(low=_scaled_amax(facts, _judged_amax(g)) < UNDERFLOW_SCALED_AMAX)
        low, normal = g[g["low"]], g[~g["low"]]
        if not len(low):
            continue
        frac = float(low["grad_zero_frac"].median())
        base = float(normal["grad_zero_frac"].median()) if len(normal) else 0.0
        if frac >= UNDERFLOW_MIN_FRAC and frac - base >= UNDERFLOW_EXCESS:
            hits.append((frac - base, name, frac, base, low, len(normal) > 0))
    if not hits:
        return []
    hits.sort(key=lambda h: -h[0])
    _, name, frac, base, low, has_base = hits[0]
    first, last = int(low["step"].min()), int(low["step"].max())
    # at most three more names, and how many are left out: the title counts every parameter
    others = ", ".join(h[1] for h in hits[1:4]) + (f" (+{len(hits) - 4} more)" if len(hits) > 4 else "")
    scale_txt = num(float(facts.scale_at()[first])) if facts.scaling else "1 (no scaler)"
    return [facts.finding(
        "grad-underflow", "warning",
        f"Gradients underflow to zero at low loss scale ({counted(len(hits), 'parameter')}, worst {name})",
        first, last,
        f"{name}: {frac:.0%} of gradient elements exactly zero at low scale (median over "
        f"{counted(len(low), 'recorded step')}, scale {scale_txt} at step {first:,}) against "
        + (f"{base:.0%} at normal scale" if has_base else "no step at a normal scale to compare with")
        + (f"; also {others}" if others else ""),
        _underflow_advice(facts, name, float(facts.scale_at()[first]) if facts.scaling else None))]


def _underflow_advice(facts: Facts, name: str, scale: Optional[float]) -> str:
    """What to change; never an init_scale or growth_interval the run already had."""
    if scale is None:
        return "Use a GradScaler (torch.amp.GradScaler) so gradients are scaled into fp16's range."
    init, gi = facts.info.get("init_scale"), facts.info.get("growth_interval")
    if init is None or init < 2.0 ** 16 or (gi or 0) > 2000:
        return ("Raise the loss scale: init_scale=2**16 and the default growth_interval=2000; if the scale "
                "collapsed first, fix that overflow (see scale-collapse).")
    keep = f"keep the layers that produce {name}'s gradient in fp32 (autocast disabled around them), or use bf16 autocast."
    starts = "K" + keep[1:]  # the same clause, starting a sentence
    if scale < init:
        return (f"A larger init_scale would not help: the run started at {num(init)} and the scaler backed off "
                f"to {num(scale)} because larger scales overflowed. {starts} If those "
                f"overflows are a fault (see the findings on skipped steps), fixing them lets the scale stay higher.")
    if scale < 2.0 ** 24:
        return (f"Start higher than the {num(scale)} these steps ran at, init_scale=2**24 (GradScaler backs off "
                f"by itself where that overflows), or {keep}")
    return f"{name}'s gradients are below fp16's range even at a loss scale of {num(scale)}: {starts}"


def leaf_modules(facts: Facts) -> set[str]:
    """Modules without children that do not compute in fp32 under autocast."""
    mods = facts.tensors[facts.tensors["kind"] == "module"]
    parents = {n.rsplit(".", 1)[0] for n in mods["name"] if "." in n}
    return {n for n, t in zip(mods["name"], mods["type"])
            if n not in parents and n != "<model>" and t not in FP32_MODULE_TYPES}


def activation_headroom(facts: Facts) -> list[Finding]:
    """Warning: a leaf module's fp16 activations within HEADROOM_FACTOR of 65504, sustained."""
    if not facts.fp16:
        return []
    limit = FP16_MAX / HEADROOM_FACTOR
    # HEADROOM_MIN_ROWS rows in a row need at least that many rows at the limit: count those in
    # SQLite, then read the forward history of just the modules that have enough.
    reaching = facts.modules_reaching(limit, facts.healthy_end, leaf_modules(facts))
    suspects = {name for name, n in reaching.items() if n >= HEADROOM_MIN_ROWS}
    if not suspects:
        return []
    fwd = facts.forward_activations(facts.healthy_end, suspects)
    hits = []
    for name, g in fwd.groupby("module", sort=False):
        near = (g["amax"].astype(float) >= limit).to_numpy()
        best, cur, start, best_start = 0, 0, 0, 0
        for i, flag in enumerate(near):
            cur = cur + 1 if flag else 0
            if cur == 1:
                start = i
            if cur > best:
                best, best_start = cur, start
        if best >= HEADROOM_MIN_ROWS:
            rows = g.iloc[best_start:best_start + best]
            hits.append((float(rows["amax"].max()), name, rows))
    if not hits:
        return []
    hits.sort(key=lambda h: -h[0])
    peak, name, rows = hits[0]
    first, last = int(rows["step"].iloc[0]), int(rows["step"].iloc[-1])
    others = ", ".join(h[1] for h in hits[1:4])
    return [facts.finding(
        "activation-headroom", "warning",
        f"Activations of {name} are within {FP16_MAX / peak:.1f}x of the fp16 limit",
        first, last,
        f"max |output| of {name} up to {num(round(peak))} against fp16's 65,504 on {len(rows)} recorded "
        f"steps in a row ({span(first, last)})" + (f"; also {others}" if others else ""),
        f"{name} will overflow to inf with a little more growth: keep it in fp32 (autocast disabled for "
        f"it), switch to bf16 autocast, or rescale it (a normalization before it, smaller init or "
        f"weight decay on the layer feeding it).")]


def _serious_events(facts: Facts) -> pd.DataFrame:
    """Events the scaler cannot absorb: forward/loss ones anywhere, gradient ones without a scaler or
    at a scale <= 1 (a scaled gradient overflow at a normal scale is the scaler's everyday job)."""
    ev = facts.events
    if not len(ev):
        return ev
    if facts.warmup:
        ev = ev[~ev["step"].isin(facts.warmup.skips)]
    fwd = ev["phase"].isin(["forward", "input"]) & ev["origin"]
    loss = ev["phase"] == "loss"
    grad = ((ev["phase"] == "backward") & ev["origin"]) | (ev["phase"] == "param_grad")
    if facts.scaling:
        grad &= ev["step"].map(facts.scale_at()).fillna(np.inf) <= 1.0
    return ev[fwd | loss | grad]


_PHASE_RANK = {"input": -1, "forward": 0, "backward": 1, "loss": 2, "param_grad": 3}


def is_attention(module: str, cls: Optional[str]) -> bool:
    """An attention module by its class or name (GPT2Attention, MultiheadAttention, ``h.1.attn``):
    where the logits Q·Kᵀ, computed in the module's own code, are the value that overflows."""
    last = module.rsplit(".", 1)[-1].lower()
    return "attention" in (cls or "").lower() or last in ("attn", "attention", "self_attn", "self_attention")


def _intermediate_advice(module: str, cls: Optional[str], dtype: str) -> str:
    if is_attention(module, cls):
        return (f"The attention logits (Q·Kᵀ) of {module} most likely exceed {dtype}'s range: scale them before "
                f"the product (q and k each by d_head**-0.25) or compute them in fp32 (upcast q and k, or the "
                f"model's option to upcast attention), use torch's scaled_dot_product_attention (attn_implementation="
                f"\"sdpa\"), which never materialises them in {dtype}, or train with bf16 autocast")
    return (f"Keep {module} in fp32 (torch.autocast(device_type, enabled=False) around it, its input cast by "
            f".float()) or use bf16 autocast: a value computed inside it exceeds {dtype}'s range although its "
            f"output does not")


def fp32_verdict(e: pd.Series, dtype: str, cls: Optional[str] = None) -> tuple[str, str, bool]:
    """(evidence, advice, decided) from the recompute of a forward origin. ``decided`` is False
    when there is no verdict: no recompute was done, or it did not reproduce the non-finite values
    (finite in fp32 within ``dtype``'s largest finite value, ``DTYPE_MAX``, and finite again when
    re-run in the call's own dtypes, ``lowp_amax``: what acted on the call differs from the
    recompute); the advice is then empty. Finite in fp32 but non-finite again in the call's own
    dtypes: an intermediate value inside the module overflows (``cls``, the module's class, picks
    the advice: attention logits or not)."""
    amax = e.get("fp32_amax")
    if e["phase"] != "forward" or amax is None:
        return "", "", False
    module = e["module"]
    limit = DTYPE_MAX.get(dtype, FP16_MAX)
    if amax != amax or amax == float("inf"):
        what = "NaN" if amax != amax else "inf"
        return (f"; recomputed in fp32 on the same inputs it is {what} too: not a precision problem",
                f"Not a precision problem: {module}'s weights or inputs are broken, or the operation itself makes "
                f"{what} (0/0, log or sqrt of a negative, inf-inf); more precision will not help, find what broke "
                f"them", True)
    if amax > limit:
        return (f"; recomputed in fp32 on the same inputs it is finite (max {num(amax)}, beyond {dtype}'s "
                f"{num(limit)}): {dtype}'s range is the problem",
                f"Keep {module} in fp32 (torch.autocast(device_type, enabled=False) around it, input "
                f"cast by .float()) or use bf16 autocast: the values are real, only {dtype} cannot hold them", True)
    lowp = e.get("lowp_amax")
    if lowp is not None and not (lowp == lowp and abs(lowp) != float("inf")):
        what = "NaN" if lowp != lowp else "inf"
        return (f"; recomputed in fp32 on the same inputs it is finite (max {num(amax)}), re-run in {dtype} on them "
                f"it is {what} again: an intermediate inside the module overflows {dtype}"
                + (" (in an attention module: most likely the logits Q·Kᵀ)" if is_attention(module, cls) else ""),
                _intermediate_advice(module, cls, dtype), True)
    if lowp is not None:
        return (f"; recomputed on the inputs kept from its call it is finite both in fp32 (max {num(amax)}) and "
                f"re-run in {dtype} (max {num(lowp)}): the recompute did not reproduce it (a forward hook that "
                f"changes the module's output is not re-run, its inputs may have been replaced, or the module "
                f"depends on state that changed since: a counter, a cache, Python state), so there is no fp32 "
                f"verdict", "", False)
    return (f"; recomputed in fp32 on the inputs kept from its call its max |output| is only {num(amax)}, "
            f"which {dtype} holds: the recompute did not reproduce it (a forward hook that changes the "
            f"module's output is not re-run, its inputs may have been replaced, or {dtype}'s rounding rather "
            f"than its range made the difference), so there is no fp32 verdict", "", False)


def nonfinite_origin(facts: Facts) -> list[Finding]:
    """Error: the first step where NaN/Inf was born (outside warm-up): module, phase, kind."""
    ev = _serious_events(facts)
    # a batch that brought NaN/Inf in, read from its saved bytes: said before any origin they may
    # hide (the recorder's `input` event says it without them), unless a module made NaN/Inf of its
    # own from finite inputs on that step: a model that cleans NaN-padded inputs first is fed NaN
    # on every step, and then the fault is that module's
    made = set(ev.loc[(ev["phase"] == "forward") & ev["origin"], "step"]) if len(ev) else set()
    brought = [s for s in facts.saved_input_steps if s not in made and facts.nonfinite_inputs(s)]
    if brought and (not len(ev) or brought[0] <= int(ev["step"].min())):
        first = brought[0]
        later = facts.events[facts.events["step"] >= first]["step"] if len(facts.events) else []
        bad_steps = sorted(set(int(s) for s in later) | {first})
        facts.claims["nonfinite-origin"] = ("<inputs>", "forward")
        return [_input_origin(facts, first, bad_steps, facts.nonfinite_inputs(first))]
    if not len(ev):
        return []
    first = int(ev["step"].min())
    at_first = ev[ev["step"] == first].copy()
    at_first["rank"] = at_first["phase"].map(_PHASE_RANK)
    e = at_first.sort_values(["rank"]).iloc[0]
    module, phase = e["module"], e["phase"]
    bad_steps = sorted(set(int(s) for s in ev["step"]))
    if phase == "input":
        facts.claims["nonfinite-origin"] = ("<inputs>", "forward")
        return [_input_event_origin(facts, e, first, bad_steps)]
    same = ev[(ev["module"] == module) & (ev["phase"] == phase)]["step"].nunique()
    label = facts.module_label(module)
    what = {"forward": f"the forward output of {label}", "backward": f"the gradient {label} passes back",
            "loss": "the loss", "param_grad": f"the gradient of parameter {module}{facts.also(module)}"}[phase]
    # "12,868 inf values", "1 NaN value"; uncounted (the accelerator path's maxima): "NaN/Inf values"
    count = f"{int(e['count']):,} " if pd.notna(e["count"]) else ""
    values = "value" if pd.notna(e["count"]) and int(e["count"]) == 1 else "values"
    dtype = f", {e['dtype']}" if isinstance(e["dtype"], str) else ""
    dtype_name = e["dtype"] if isinstance(e["dtype"], str) else "float16"
    extra, advice = origin_advice(facts, module, phase, first, e["kind"], dtype_name)
    verdict, fp32_advice, decided = fp32_verdict(e, dtype=dtype_name, cls=facts.module_type(module))
    if fp32_advice and not extra:  # an overwritten weight is the more specific cause: its advice stays
        advice = fp32_advice
    elif verdict and not decided and not extra and "nan" not in str(e["kind"]):  # recomputed, not reproduced
        advice = (f"The fp32 recompute did not reproduce it, so this is not confirmed: first check what else acts "
                  f"on {module} at step {first:,} (a forward hook that rescales its output, inputs replaced after "
                  f"the call); if its values are real: " + advice[0].lower() + advice[1:])
    into = e.get("flows_into")
    where = (f"; made in {module}'s own code (between its children), flowing into {into}"
             if isinstance(into, str) else "")
    facts.claims["nonfinite-origin"] = (module, phase)
    ignored = facts.ignored_labels(first) if e["kind"] == "nan" and phase in ("loss", "forward") else []
    if ignored:
        return [_no_target_tokens(facts, first, bad_steps, ignored)]
    if phase == "loss" and e["kind"] == "nan" and _gradients_all_zero(facts, first):
        return [_empty_mean(facts, first, bad_steps)]
    evidence = (f"step {first:,}: {what} holds {count}{e['kind']} {values}{dtype}"
                + (" while its inputs were finite" if e["origin"] else "")
                + f"; non-finite values at {counted(len(bad_steps), 'step')} ({span(bad_steps[0], bad_steps[-1])}),"
                  f" {same:,} of them born in the same place" + where + verdict + extra)
    kind = {"nan": "NaN", "inf": "Inf"}.get(e["kind"], "NaN/Inf")
    cls = facts.module_type(module)
    title = (f"Loss became {kind} at step {first:,}" if phase == "loss" else
             f"{kind} born in {module} ({cls + ', ' if cls else ''}{phase}) at step {first:,}")
    advice += "." + facts.saved_inputs_text(first)
    return [facts.finding("nonfinite-origin", "error", title, first, bad_steps[-1], evidence, advice,
                          jump=facts.jump(first, first))]


def _input_origin(facts: Facts, first: int, bad_steps: list[int], bad_inputs: list) -> Finding:
    """The batch itself held NaN/Inf: the model's saved inputs of ``first`` were read back from the
    run file. No module's arithmetic is at fault, and no precision setting fixes it."""
    parts = []
    for name, micro_batch, nan, inf, numel in bad_inputs:
        held = " and ".join(f"{n:,} {what}" for n, what in ((nan, "NaN"), (inf, "inf")) if n)
        parts.append(f"{name}{f' (micro-batch {micro_batch})' if micro_batch else ''} holds {held} of "
                     f"{numel:,} values")
    kind = "NaN" if any(b[2] for b in bad_inputs) else "Inf"
    title = f"{kind} in the model's input batch at step {first:,}"
    evidence = (f"step {first:,}: the inputs saved from the step, read back from the run file: " + "; ".join(parts)
                + f". Non-finite values at {counted(len(bad_steps), 'step')} ({span(bad_steps[0], bad_steps[-1])})")
    advice = (INPUT_FIX.replace("data pipeline", "data pipeline (the saved inputs' sha256 identifies it)") + "."
              + facts.saved_inputs_text(first))
    return facts.finding("nonfinite-origin", "error", title, first, bad_steps[-1], evidence, advice,
                         jump=facts.jump(first, first))


def _input_event_origin(facts: Facts, e: pd.Series, first: int, bad_steps: list[int]) -> Finding:
    """The model's own inputs held NaN/+inf as its forward began (the recorder's ``input`` event),
    where their bytes are not in the run file to say more (not saved: save_batches=False, over the
    budget, or a path that keeps no inputs of that step)."""
    kind = {"nan": "NaN", "inf": "Inf"}.get(e["kind"], "NaN/Inf")
    count = f"{int(e['count']):,} " if pd.notna(e["count"]) else ""
    values = "value" if pd.notna(e["count"]) and int(e["count"]) == 1 else "values"
    dtype = f" ({e['dtype']})" if isinstance(e["dtype"], str) else ""
    micro = f" (micro-batch {int(e['micro_batch'])})" if pd.notna(e.get("micro_batch")) and e["micro_batch"] else ""
    title = f"{kind} in the model's input batch at step {first:,}"
    saved = facts.saved_input_steps
    if first in saved:
        unsaved = ""
    elif saved and saved[-1] < first:
        unsaved = (f"; its bytes are not in the run file, which kept the inputs of the first bad steps only "
                   f"({counted(len(saved), 'step')})")
    else:
        unsaved = "; its bytes are not in the run file (save_batches=False, or its inputs were not kept on that step)"
    evidence = (f"step {first:,}: the model's floating-point inputs{micro} held {count}{e['kind']} {values}{dtype}"
                f" as its forward began, before any module ran{unsaved}. Non-finite values at "
                f"{counted(len(bad_steps), 'step')} ({span(bad_steps[0], bad_steps[-1])})")
    return facts.finding("nonfinite-origin", "error", title, first, bad_steps[-1], evidence, INPUT_FIX + "."
                         + facts.saved_inputs_text(first), jump=facts.jump(first, first))


_NO_TOKENS_FIX = ("Drop such samples before batching (a prompt truncated to the whole sequence leaves only ignored "
                  "labels), or divide the summed loss by the step's count of target tokens, guarded against 0 "
                  "(Hugging Face: num_items_in_batch).")


def _no_target_tokens(facts: Facts, first: int, bad_steps: list[int], ignored: list) -> Finding:
    """Every label of the batch is the ignore index: a mean cross-entropy over 0 tokens is 0/0."""
    name, micro_batch, value, numel = ignored[0]
    where = f"{name}{f' (micro-batch {micro_batch})' if micro_batch else ''}"
    title = f"Loss became NaN at step {first:,}: every label of its batch is {value}"
    evidence = (f"step {first:,}: the loss is NaN; {where}, saved from the step, holds {numel:,} values, all {value} "
                f"(the ignore index): the loss averages over zero target tokens, 0/0. Non-finite values at "
                f"{counted(len(bad_steps), 'step')} ({span(bad_steps[0], bad_steps[-1])})")
    advice = "Not a precision problem: the batch has no token to learn from. " + _NO_TOKENS_FIX + \
        facts.saved_inputs_text(first)
    return facts.finding("nonfinite-origin", "error", title, first, bad_steps[-1], evidence, advice,
                         jump=facts.jump(first, first))


def _gradients_all_zero(facts: Facts, step: int) -> bool:
    """Whether ``step``'s recorded gradient norm is exactly 0 (a NaN loss whose gradient is zero
    everywhere: nothing the model computed depends on the NaN)."""
    row = facts.steps[facts.steps["step"] == step]
    return len(row) == 1 and bool(row["grad_norm"].iloc[0] == 0.0)


def _empty_mean(facts: Facts, first: int, bad_steps: list[int]) -> Finding:
    """A NaN loss with all-zero gradients: the loss divided 0 by 0 (a mean over no element)."""
    skipped = bool(facts.steps.loc[facts.steps["step"] == first, "skipped"].iloc[0])
    title = f"Loss became NaN at step {first:,} while its gradients were all zero"
    evidence = (f"step {first:,}: the loss is NaN and the gradient norm is exactly 0, not NaN"
                + ("" if skipped else ", so nothing skipped the step") + ": the NaN is the loss's own 0/0, a mean "
                f"over no element, with nothing of the model's output left in it. Non-finite values at "
                f"{counted(len(bad_steps), 'step')} ({span(bad_steps[0], bad_steps[-1])})")
    advice = ("Not a precision problem: most often every label of the batch is the ignore index (-100), so a mean "
              "cross-entropy averages over zero target tokens. " + _NO_TOKENS_FIX + facts.saved_inputs_text(first))
    return facts.finding("nonfinite-origin", "error", title, first, bad_steps[-1], evidence, advice,
                         jump=facts.jump(first, first))
