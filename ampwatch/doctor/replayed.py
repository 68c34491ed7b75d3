"""A skipped step whose replay came out finite: what that rules out, and what is left."""
from __future__ import annotations

from .facts import Facts
from .finding import Finding, span

# The recorder's notice for a replay that ran (weights, inputs, RNG and autocast state as the step
# had them) and made no non-finite gradient; other replay-not-reproduced notices say why it could
# not run (an input changed in place, a model that refuses a second backward).
RAN_FINITE = "came out finite"


def step_not_reproduced(facts: Facts) -> list[Finding]:
    """Warning: a skipped step that ran again with everything the same and came out finite."""
    n = facts.notices
    if not len(n):
        return []
    hits = n[(n["code"] == "replay-not-reproduced") & n["message"].str.contains(RAN_FINITE, regex=False)
             & n["step"].notna()]
    if not len(hits):
        return []
    steps = sorted(int(s) for s in hits["step"])
    first, last = steps[0], steps[-1]
    return [facts.finding(
        "step-not-reproduced", "warning",
        f"Skipped step {first:,} did not reproduce: run again with the same weights and inputs it was finite",
        first, last,
        f"the replay of {span(first, last)} ran the step again before any weight changed, on the same inputs "
        f"(checked unchanged by their version counters), with the RNG state and the autocast state the step "
        f"had, from the same output gradients, and every gradient came out finite: weights, inputs, RNG and "
        f"autocast state are ruled out. What is left: a transient fault (a hardware error, e.g. a bit flip "
        f"in memory or a faulty GPU; a race in a kernel or between streams), a nondeterministic kernel, or "
        f"state outside the tensors that changes the computation (Python attributes, counters, caches)",
        "Rerun this step on another device (or the same one, several times) from the checkpoint before it: "
        "if it comes out finite there, suspect the hardware (run the vendor's diagnostics, e.g. "
        "nvidia-smi -q -d ECC or dcgmi diag). Check the model for Python state that changes what a call "
        "computes (a counter, a flag, a cache) and for nondeterministic kernels "
        "(torch.use_deterministic_algorithms(True)). If it recurs at random steps, treat it as hardware.",
        jump=facts.jump(first, last))]
