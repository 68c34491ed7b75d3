"""Rules about how the scaler is used: bf16 with a scaler, fp16 without one, clipping scaled
gradients, and the misuse the recorder noticed while recording."""
from __future__ import annotations


import numpy as np

from .finding import Finding, counted, num, span
from ..store.reader import clip_threshold
from .facts import Facts


# Clipping still-scaled gradients: a logged norm that is the scale times the true norm (within 2x)
# on most steps; the scale must be large enough (16) that "x scale" cannot be noise.
CLIP_RATIO_BAND = (0.5, 2.0)
CLIP_MIN_SCALE = 16.0
CLIP_MIN_STEPS = 5


def misuse_config(facts: Facts) -> list[Finding]:
    """Scaler with bf16 (unnecessary), fp16 without a scaler, a scaler without autocast."""
    info, out = facts.info, []
    if not len(facts.steps):
        # Still running: the first step may not have ended. A run that ended without one recorded
        # nothing it trained (a crash says why itself: run-crashed explains this finding).
        status = info.get("status")
        ended = status not in (None, "running")
        return [facts.finding(
            "no-steps", "warning" if ended else "info", "No optimizer steps were recorded", 0, 0,
            f"the steps table is empty and the run is {status or 'running'}",
            "With an enabled GradScaler a step is counted at scaler.update(), so a loop that calls "
            "optimizer.step() itself records nothing; without one, or with GradScaler(enabled=False), at "
            "optimizer.step() (or scaler.update() after scaler.step()). Check the loop calls them"
            + ("." if ended else ", or that the run has started."), jump=(0, 0))]
    first, last = facts.first_step, facts.last_step
    dtype, scaler = info.get("amp_dtype"), info.get("scaler_enabled")
    if scaler and dtype == "bfloat16":
        skipped = int(facts.steps["skipped"].sum())
        out.append(facts.finding(
            "misuse-scaler-bf16", "warning", "GradScaler used with bfloat16 autocast: not needed", first, last,
            f"amp_dtype=bfloat16 with an enabled GradScaler; {counted(skipped, 'step')} skipped",
            "bf16 has fp32's exponent range, so loss scaling buys nothing and costs skipped steps: "
            "drop the scaler (loss.backward(); optimizer.step()) or GradScaler(enabled=False).",
            jump=(first, last)))
    if dtype == "float16" and not scaler:
        out.append(facts.finding(
            "misuse-fp16-no-scaler", "warning", "fp16 autocast without a GradScaler",
            first, last, "amp_dtype=float16 and no enabled GradScaler",
            "Small gradients underflow to zero in fp16: use scaler = torch.amp.GradScaler(device); "
            "scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update() "
            "(or bf16 autocast).",
            jump=(first, last)))
    if not facts.has_loss:
        out.append(facts.finding(
            "no-loss", "info", "No loss was recorded", first, last,
            f"{counted(len(facts.steps), 'step')}, none with a loss: "
            + ("the GradScaler scaled none" if scaler else "without a GradScaler the loss arrives only through "
               "watch.log(loss=...), and it was never called"),
            "Pass the loss each step: watch.log(loss=loss) after loss.backward() (the Hugging Face and Lightning "
            "callbacks do it themselves). Without it the doctor cannot see the loss diverge or spike, nor a NaN "
            "loss whose gradients stayed finite, and the charts have no loss to draw.", jump=(first, last)))
    if scaler and not dtype:
        out.append(facts.finding(
            "misuse-scaler-no-autocast", "info", "GradScaler enabled but no autocast was seen",
            first, last, "no autocast region was active at the model's first forward",
            "In fp32 a GradScaler is not needed; if you meant mixed precision, wrap the forward in "
            "torch.autocast(device_type, dtype=torch.float16).", jump=(first, last)))
    return out


def misuse_clip_scaled(facts: Facts) -> list[Finding]:
    """Warning: a logged gradient norm equals scale x the true norm: clipping before unscale_."""
    if not facts.scaling or not len(facts.norm_metrics):
        return []
    m = facts.norm_metrics
    if len(facts.notices) and (facts.notices["code"] == "clip-before-unscale").any():
        return []  # the recorder saw it directly: misuse_notices reports it, once
    s = facts.steps[~facts.steps["skipped"]].set_index("step")
    out = []
    for key, g in m[m["key"].str.contains("norm", case=False)].groupby("key"):
        g = g[g["step"].isin(s.index)]
        scale, true = g["step"].map(s["loss_scale"]).astype(float), g["step"].map(s["grad_norm"]).astype(float)
        ok = (scale >= CLIP_MIN_SCALE) & np.isfinite(true) & (true > 0) & np.isfinite(g["value"])
        ratio = (g["value"] / (true * scale))[ok]
        if len(ratio) < CLIP_MIN_STEPS:
            continue
        inside = ratio.between(*CLIP_RATIO_BAND).mean()
        if inside >= 0.5:
            steps = g.loc[ok, "step"]
            clip = clip_threshold(facts.info)
            out.append(facts.finding(
                "misuse-clip-scaled", "warning", "Gradients were clipped while still scaled",
                int(steps.min()), int(steps.max()),
                f"logged '{key}' is {ratio.median():.3g} x scale x the true gradient norm on {inside:.0%} of "
                f"{len(ratio):,} steps (e.g. {num(float(g.loc[ok, 'value'].iloc[0]))} at scale "
                f"{num(float(scale[ok].iloc[0]))}, true norm {num(float(true[ok].iloc[0]))})",
                "Call scaler.unscale_(optimizer) before torch.nn.utils.clip_grad_norm_: on scaled gradients "
                f"max_norm{'=' + str(clip) if clip else ''} clips scale-times too hard and training barely moves."))
    return out


def _steps_text(steps: list[int], limit: int = 8) -> str:
    shown = ", ".join(f"{x:,}" for x in steps[:limit])
    return shown + (f" and {len(steps) - limit:,} more" if len(steps) > limit else "")


def clip_evidence(facts: Facts, noticed: list[int], once: bool = False) -> tuple[str, int]:
    """(evidence, last affected step) for clip-before-unscale notices. The recorder checks on the
    layer_every steps that were not skipped (a skipped step's gradients are not finite to compare)
    and writes a notice on each that shows the gradients shrinking: when every check from the first
    notice on shows it, the loop does it on every step, to the run's last. ``once``: a run recorded
    before that, whose recorder wrote one notice and then stopped checking."""
    if once:
        return (f"the recorder saw the gradients shrink without scaler.unscale_ at step {noticed[0]:,}; it noted "
                f"this once per run then, so later steps were not checked"), noticed[0]
    every = int(facts.info.get("layer_every") or 0)
    s = facts.steps
    first = noticed[0]
    steps = s["step"].to_numpy()
    checked = ([int(x) for x in steps[(steps >= first) & ~s["skipped"].to_numpy() & (steps % every == 0)]]
               if every else [])
    if every and len(checked) > 1 and set(checked) <= set(noticed):
        return (f"the recorder saw the gradients shrink without scaler.unscale_ on every step it checked from step "
                f"{first:,} on ({len(checked):,} checks, one every layer_every={every} steps: "
                f"{_steps_text(checked)}): the loop clips scaled gradients on every step, steps "
                f"{first:,}-{facts.last_step:,}"), facts.last_step
    of = f" of {len(checked):,} checked (every layer_every={every} steps)" if every and len(checked) > 1 else ""
    return (f"the recorder saw the gradients shrink without scaler.unscale_ at {counted(len(noticed), 'step')}{of}: "
            f"{_steps_text(noticed)}"), noticed[-1]


# notices that are the recorder's own notes about the run, not a misuse of the loop's: info
_RECORDER_NOTES = ("replay-not-reproduced", "skip-read-within-step", "check-read-before-update",
                   "step-unfinished", "replay-outputs-gone", "resume-numbered-from-0")


def misuse_notices(facts: Facts) -> list[Finding]:
    """Warnings for misuse the recorder noticed while recording (notices table)."""
    n = facts.notices
    if not len(n):
        return []
    advice = {"step-without-update": "Call scaler.update() once after every scaler.step(optimizer); without it "
                                     "the scale never adapts and the scaler refuses the next step.",
              "clip-before-unscale": "Call scaler.unscale_(optimizer) before torch.nn.utils.clip_grad_norm_: on "
                                     "scaled gradients max_norm clips scale-times too hard.",
              # not a misuse: the recorder's own note that one skipped step went unlocalized
              "replay-not-reproduced": "Nothing to change in the loop. Later bad steps are localized live; "
                                       "attach with replay=False to observe every step from the start.",
              # not a misuse: a replay that could not ask the step's own outputs (nonfinite-origin says more)
              "replay-outputs-gone": "To tell a NaN target from a fault of the forward that did not recur, "
                                     "keep the model's output in a variable until the step ends (logits = "
                                     "model(x); loss = loss_fn(logits, y)): a replay then reads it.",
              # not a misuse: the recorder's own note of why a fused step waits for the device
              "skip-read-within-step": "Compute the loss inside the model (a Hugging Face model's labels=, "
                                       "nanoGPT's targets) so that a step keeps one number for a replay "
                                       "instead of the logits' gradient, and its skip flag is read a step "
                                       "late without waiting; or leave more device memory free.",
              "check-read-before-update": "Use torch.optim.AdamW(fused=True) (or Adam), with step() called "
                                          "without arguments: its kernel takes the check as its skip flag, "
                                          "and the host reads it once the update is queued instead of "
                                          "waiting before it. With another optimizer, leave the device "
                                          "room for a copy of the weights (the notice says how much) and "
                                          "keep_weights=True: the check is then read a step late.",
              # not a misuse: the run closed inside a step (a loop that raised on a NaN loss)
              "step-unfinished": "Nothing to change for the recording: the step's row holds its loss, "
                                 "gradient norms and module values as far as the step got, so the "
                                 "findings at that step say what went wrong in it.",
              # not a misuse: a run attached to an optimizer that had already made updates
              "resume-numbered-from-0": "If this run goes on from a checkpoint, pass the step it resumes at to "
                                        "attach (first_step=N; the framework callbacks pass the trainer's "
                                        "global step): its rows, findings and tracker series then carry the "
                                        "loop's own step numbers. Nothing to change otherwise.",
              # not a misuse either: the recorder failed and stopped (training went on)
              "recording-stopped": "Training went on; this file ends at that step. Unless the message names "
                                   "something your loop passed, it is an ampwatch bug: please report the "
                                   "message, and attach again (strict=True raises it where it happens)."}
    out = []
    for code, g in n.groupby("code", sort=False):
        steps = sorted({int(x) for x in g["step"].dropna()}) or [facts.first_step]
        first, last = min(steps), max(steps)
        evidence = f"recorder notice '{code}' at {counted(len(g), 'step')}: {span(first, last)}"
        if code == "clip-before-unscale":
            evidence, last = clip_evidence(facts, steps, once=" at step " not in str(g["message"].iloc[0]))
        out.append(facts.finding(
            f"misuse-{code}", "info" if code in _RECORDER_NOTES else "warning",
            str(g["message"].iloc[0]), first, last, evidence,
            advice.get(code, "See the message: the recorder saw the training loop use the scaler "
                             "in an unexpected order."), jump=facts.jump(first, last)))
    return out
