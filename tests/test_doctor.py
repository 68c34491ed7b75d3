"""The doctor on real recorded runs: one faulty run per rule that must fire it, and healthy MLP, CNN
and transformer runs on which no rule may warn. Faults come from real mechanisms: an
outlier batch, a module whose output overflows, a tiny init_scale, gradient ascent, misuse of the
scaler. Each run is recorded once per module (fixtures) and only read afterwards."""
from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch
from click.testing import CliRunner
from torch import nn
from torch.nn import functional as F

import ampwatch
from ampwatch.doctor import rules
from ampwatch.cli.main import cli
from ampwatch.samples.models import TinyGPT, batches
from ampwatch.cli.report import format_report
from ampwatch.doctor import Finding, diagnose

SAMPLES = Path(__file__).parent.parent / "sample_runs"


# -- models and data ----------------------------------------------------------------------------------

class Outlier(nn.Module):
    """Multiplies its input by ``factor`` on the steps in ``steps``: an outlier batch inside the net."""

    def __init__(self, factor: float = 1e5) -> None:
        super().__init__()
        self.factor, self.steps, self.step = factor, set(), -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor if self.step in self.steps else x


class NearLimit(nn.Module):
    """Rescales its input so that max |x| == target: an activation living close to fp16's limit."""

    def __init__(self, target: float) -> None:
        super().__init__()
        self.target = target

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (self.target / x.detach().abs().amax())


class Gain(nn.Module):
    def __init__(self, k: float) -> None:
        super().__init__()
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.k


def mlp(*middle: nn.Module, width: int = 32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, width), *middle, nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 4))


def regression(seed: int = 0, batch: int = 32):
    """A learnable target (a fixed random teacher), so healthy runs converge."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(16, 4, generator=g) / 4
    while True:
        x = torch.randn(batch, 16, generator=g)
        yield x, torch.tanh(x @ teacher), F.mse_loss


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.relu(self.conv2(x)).mean(dim=(2, 3))
        return self.head(x)


def quadrants(seed: int = 0, batch: int = 32):
    """8x8 noise images with one brighter quadrant; the label is which one (learnable by a CNN)."""
    g = torch.Generator().manual_seed(seed)
    while True:
        label = torch.randint(0, 4, (batch,), generator=g)
        x = torch.randn(batch, 1, 8, 8, generator=g)
        for q, (r, c) in enumerate([(0, 0), (0, 4), (4, 0), (4, 4)]):
            x[label == q, :, r:r + 4, c:c + 4] += 1.0
        yield x, label, F.cross_entropy


def tokens(seed: int = 0):
    for x, y in batches(32, 16, 8, seed):
        yield x, y, lambda logits, target: F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


# -- one training loop for every scenario --------------------------------------------------------------

def record(path: Path, model: nn.Module, data, steps: int, *, dtype=torch.float16, scaler: Optional[dict] = None,
           lr: float = 0.05, adam: bool = False, fault: Optional[Callable] = None, clip: Optional[float] = None,
           clip_before_unscale: bool = False, log_norm: bool = False, step_twice_at: Optional[int] = None,
           layer_every: int = 10, localize: bool = True) -> ampwatch.Run:
    """Train ``model`` under fp16/bf16 autocast (scaler=None: no GradScaler) and return the run.

    ``fault(step, model, opt, x, y) -> (x, y)`` may change the batch, the model or the optimizer."""
    opt = (torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0) if adam
           else torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))
    gs = torch.amp.GradScaler("cpu", **scaler) if scaler is not None else None
    config = {"max_grad_norm": clip} if clip else {}
    with ampwatch.attach(model, opt, gs, path=str(path), config=config, layer_every=layer_every,
                         localize=localize) as watch:
        for step in range(steps):
            x, y, loss_fn = next(data)
            for m in model.modules():
                if isinstance(m, Outlier):
                    m.step = step
            if fault is not None:
                x, y = fault(step, model, opt, x, y)
            with torch.autocast("cpu", dtype=dtype):
                out = model(x)
            loss = loss_fn(out.float(), y)
            if gs is None:
                loss.backward()
                watch.log(loss=loss)
                opt.step()
            else:
                gs.scale(loss).backward()
                if clip is not None:
                    if not clip_before_unscale:
                        gs.unscale_(opt)
                    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                    if log_norm:
                        watch.log(clip_norm=norm)
                gs.step(opt)
                if step == step_twice_at:
                    with pytest.raises(RuntimeError, match="update"):
                        gs.step(opt)  # torch refuses; the recorder notes the misuse first
                gs.update()
            opt.zero_grad(set_to_none=True)
    return ampwatch.load(watch.path)


def ids(findings: list[Finding], severity: Optional[str] = None) -> set[str]:
    return {f.id for f in findings if severity is None or f.severity == severity}


def the(findings: list[Finding], id: str) -> Finding:
    found = [f for f in findings if f.id == id]
    assert len(found) == 1, f"expected one {id!r}, got {[f.id for f in findings]}"
    return found[0]


def serious(findings: list[Finding]) -> list[str]:
    return [f"{f.severity} {f.id}: {f.title} | {f.evidence}" for f in findings if f.severity != "info"]


# -- recorded runs (once per module) ---------------------------------------------------------------

def _ascent(step, model, opt, x, y):
    """From step 80 the optimizer climbs the gradient (a sign bug): the loss rises steadily."""
    if step == 80:
        for group in opt.param_groups:
            group["lr"], group["momentum"] = -0.01, 0.0
    return x, y


def _outliers_at(steps) -> nn.Sequential:
    model = mlp(Outlier())
    model[1].steps = set(steps)
    return model


SCENARIOS: dict[str, Callable[[Path], ampwatch.Run]] = {
    # healthy: three model families; the MLP starts at 2**24 so it has a warm-up
    "mlp": lambda p: record(p, mlp(), regression(), 300, scaler=dict(init_scale=2.0 ** 24)),
    "cnn": lambda p: record(p, SmallCNN(), quadrants(), 200, scaler={}, lr=1e-2, adam=True),
    "gpt": lambda p: record(p, TinyGPT(vocab=32, d=32, layers=2, heads=2, seq=16), tokens(), 200, scaler={},
                            lr=3e-3, adam=True),
    # one fault per rule
    "recurring": lambda p: record(p, _outliers_at(range(30, 200, 7)), regression(), 200,
                                  scaler=dict(growth_interval=5)),
    "collapse": lambda p: record(p, _outliers_at(range(40, 60)), regression(), 120, scaler={}),
    "collapse_unlocalized": lambda p: record(p, _outliers_at(range(40, 60)), regression(), 120, scaler={},
                                             localize=False),
    "stuck": lambda p: record(p, mlp(), regression(), 250, scaler=dict(init_scale=2.0 ** -14, growth_interval=10 ** 6)),
    "stuck_short": lambda p: record(p, mlp(), regression(), 120, scaler=dict(init_scale=2.0 ** -14,
                                                                             growth_interval=10 ** 6)),
    "headroom": lambda p: record(p, mlp(NearLimit(30000.0), Gain(1 / 30000.0)), regression(), 60, scaler={}),
    "bad_batch": lambda p: record(p, mlp(), regression(), 100, scaler={},
                                  fault=lambda s, m, o, x, y: (x * 1e6 if s == 60 else x, y)),
    "bad_targets": lambda p: record(p, mlp(), regression(), 150, dtype=torch.bfloat16,
                                    fault=lambda s, m, o, x, y: (x, y * 30 if s == 100 else y)),
    "ascent": lambda p: record(p, mlp(), regression(), 160, scaler={}, fault=_ascent),
    "bf16_scaler": lambda p: record(p, mlp(), regression(), 40, dtype=torch.bfloat16, scaler={}),
    "fp16_no_scaler": lambda p: record(p, mlp(), regression(), 40),
    "clip_scaled": lambda p: record(p, mlp(), regression(), 40, scaler={}, clip=1.0, clip_before_unscale=True,
                                    log_norm=True),
    "clip_unscaled": lambda p: record(p, mlp(), regression(), 40, scaler={}, clip=1.0, log_norm=True),
    "step_twice": lambda p: record(p, mlp(), regression(), 20, scaler={}, step_twice_at=5),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Records each scenario the first time a test asks for it."""
    folder = tmp_path_factory.mktemp("doctor_runs")
    cache: dict[str, tuple[ampwatch.Run, list[Finding]]] = {}

    def get(name: str) -> tuple[ampwatch.Run, list[Finding]]:
        if name not in cache:
            run = SCENARIOS[name](folder / f"{name}.sqlite")
            cache[name] = (run, diagnose(run))
        return cache[name]
    return get


# -- healthy runs: no warning, no error ----------------------------------------------------------------

@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt"])
def test_healthy_runs_raise_no_warning(runs, name):
    run, findings = runs(name)
    assert len(run.steps) >= 200
    assert serious(findings) == []
    s = run.steps
    first = s["loss"].iloc[:20].median()
    assert s["loss"].iloc[-20:].median() < 0.7 * first  # it really trained: a healthy run, not a stalled one


def test_healthy_runs_stay_well_below_outlier_thresholds(runs):
    """The margin behind the spike thresholds: no healthy step gets even half-way on every criterion."""
    for name in ("mlp", "cnn", "gpt"):
        s = runs(name)[0].steps
        s = s[~s["skipped"]]
        for col, limits in (("loss", rules.LOSS_SPIKE), ("grad_norm", rules.GRAD_SPIKE)):
            half = dict(z=limits["z"] / 2, ratio=1 + (limits["ratio"] - 1) / 2,
                        over_max=1 + (limits["over_max"] - 1) / 2)
            assert rules.outliers(s["step"], s[col], **half) == [], (name, col)


def test_warmup_skips_are_info_and_their_events_are_not_errors(runs):
    run, findings = runs("mlp")
    skipped = [int(s) for s in run.steps.loc[run.steps["skipped"], "step"]]
    assert skipped and max(skipped) < 20 and len(run.events) > 0  # real overflow events at the start
    warm = the(findings, "warmup-skips")
    assert warm.severity == "info"
    assert warm.steps == (0, max(skipped))
    if len(skipped) == 1:  # one step, named as one
        assert "step 0, the first, skipped" in warm.title and warm.evidence.startswith("step 0, the first step")
    else:
        assert f"{len(skipped)} skipped steps in a row" in warm.title
        assert warm.evidence.startswith("steps " + ", ".join(f"{s:,}" for s in skipped[:12]))
    scales = run.steps["loss_scale"]
    assert f"-> {rules.num(scales.iloc[max(skipped) + 1])}" in warm.evidence
    assert "nonfinite-origin" not in ids(findings)


# -- one faulty run per rule ---------------------------------------------------------------------------

def test_recurring_forward_overflow_is_one_root_naming_the_module(runs):
    run, findings = runs("recurring")
    s = run.steps
    ev = run.events
    fwd_steps = sorted(set(ev.loc[ev["origin"] & (ev["phase"] == "forward"), "step"]))
    root = findings[0]
    assert root.id == "nonfinite-origin" and root.cause is None and root.steps[0] == fwd_steps[0] == 30
    assert "born in 1 (Outlier, forward)" in root.title and "Keep 1 in fp32" in root.advice
    assert f"non-finite values at {len(fwd_steps)} step{'' if len(fwd_steps) == 1 else 's'} (" in root.evidence
    # every skip is explained: forward overflows by the root, the rest by probing/lone-skip findings
    skipped = [int(x) for x in s.loc[s["skipped"], "step"]]
    assert all(any(f.steps[0] <= x <= f.steps[1] for f in findings) for x in skipped)


def test_scale_collapse_points_at_the_forward_origin(runs):
    run, findings = runs("collapse")
    f = the(findings, "scale-collapse")
    assert f.severity == "error" and f.steps[0] == 40
    assert "at 1 (forward)" in f.title and "Keep 1 in fp32" in f.advice
    # the loss scale multiplies only the gradients: a forward overflow is out of its reach
    assert f.advice.startswith("It is born in the forward, which the loss scale does not touch")
    assert "20 consecutive skipped steps (steps 40-59)" in f.evidence
    first_below = int(run.steps.loc[run.steps["loss_scale"] < 1, "step"].min())
    assert f"below 1 from step {first_below}" in f.evidence


def test_without_localization_the_doctor_says_what_it_cannot_see(runs):
    _, findings = runs("collapse_unlocalized")
    collapse, origin = the(findings, "scale-collapse"), the(findings, "nonfinite-origin")
    assert collapse.steps[0] == origin.steps[0] == 40 and "the loss" in collapse.title
    assert "localize=True" in origin.advice and "localize=True" in collapse.advice


def test_scale_stuck_low_and_gradient_underflow(runs):
    run, findings = runs("stuck")
    assert ids(findings, "warning") == {"scale-stuck-low", "grad-underflow"}
    assert "scale-collapse" not in ids(findings)  # started below 1: not a collapse
    stuck = the(findings, "scale-stuck-low")
    assert stuck.steps == (0, 249) and "init_scale=" in stuck.advice and "growth_interval" in stuck.advice
    under = the(findings, "grad-underflow")
    worst = under.title.rsplit("worst ", 1)[1].rstrip(")")
    zero = run.layers.loc[run.layers["name"] == worst, "grad_zero_frac"].median()
    assert zero >= rules.UNDERFLOW_MIN_FRAC and f"{zero:.0%}" in under.evidence


def test_short_run_at_a_low_scale_is_not_stuck(runs):
    _, findings = runs("stuck_short")
    assert "scale-stuck-low" not in ids(findings)


def test_activation_headroom_names_the_module(runs):
    run, findings = runs("headroom")
    f = the(findings, "activation-headroom")
    assert f.severity == "warning" and "Activations of 1 " in f.title
    amax = run.modules.query("module == '1' and phase == 'forward'")["amax"].max()
    assert 16376 <= amax < 65504 and rules.num(round(amax)) in f.evidence
    assert serious(findings) == [f"warning activation-headroom: {f.title} | {f.evidence}"]


def test_nonfinite_origin_of_one_bad_batch(runs):
    run, findings = runs("bad_batch")
    f = the(findings, "nonfinite-origin")
    born = run.events[run.events["origin"]].iloc[0]
    assert f.severity == "error" and f.steps == (60, 60) and int(born["step"]) == 60
    assert f"born in {born['module']} (Linear, forward) at step 60" in f.title
    assert "divergence" not in ids(findings)  # one bad batch, skipped: the run went on


def test_loss_spike_and_grad_norm_explosion_after_corrupt_targets(runs):
    run, findings = runs("bad_targets")
    spike, boom = the(findings, "loss-spike"), the(findings, "grad-norm-explosion")
    assert spike.severity == boom.severity == "warning"
    assert spike.steps[0] == 100 and "(step 100)" in spike.title and "no skip or NaN followed" in spike.evidence
    assert 100 <= boom.steps[0] <= 105
    loss = run.steps.set_index("step")["loss"]
    assert rules.num(loss[100]) in spike.evidence
    # bf16 without a GradScaler: the advice clips without an unscale_ the loop has no scaler for
    for f in (spike, boom):
        assert "clip_grad_norm_(" in f.advice and "scaler" not in f.advice, f.advice
        assert "e+" not in f.title and "e+" not in f.evidence, (f.title, f.evidence)


def test_divergence_when_the_loss_keeps_rising(runs):
    run, findings = runs("ascent")
    f = the(findings, "divergence")
    assert f.severity == "error" and 80 <= f.steps[0] <= 110 and f.steps[1] == len(run.steps) - 1
    assert "rising" in f.title and "nonfinite-origin" not in ids(findings)


@pytest.mark.parametrize("name", ["bad_targets", "ascent"])
def test_a_long_runs_step_series_worked_out_together_say_the_same(runs, name, monkeypatch):
    """Past TOGETHER_STEPS steps the loss's and the gradient norm's outliers and the rising-loss
    window are worked out at once on two threads: the same findings as one by one."""
    from ampwatch.doctor import signals
    run, alone = runs(name)
    monkeypatch.setattr(signals, "TOGETHER_STEPS", 0)
    together = diagnose(run)
    assert [f.to_dict() for f in together] == [f.to_dict() for f in alone]
    assert {"loss-spike", "grad-norm-explosion"} <= ids(together) if name == "bad_targets" else \
        "divergence" in ids(together)


@pytest.mark.parametrize("name, expected", [
    ("bf16_scaler", "misuse-scaler-bf16"),
    ("fp16_no_scaler", "misuse-fp16-no-scaler"),
    ("clip_scaled", "misuse-clip-before-unscale"),  # the recorder's notice; the metric rule stands down
    ("step_twice", "misuse-step-without-update"),
])
def test_misuse(runs, name, expected):
    _, findings = runs(name)
    assert ids(findings, "warning") == {expected}


def test_clipping_after_unscale_is_not_misuse(runs):
    _, findings = runs("clip_unscaled")
    assert serious(findings) == []


# -- the sample runs: expectations read from the files themselves --------------------------------------

def _sql(name: str, query: str) -> list[tuple]:
    conn = sqlite3.connect(f"file:{SAMPLES / name}.sqlite?mode=ro", uri=True)
    try:
        return conn.execute(query).fetchall()
    finally:
        conn.close()


def test_sample_healthy_fp16_is_only_info():
    findings = ampwatch.diagnose(str(SAMPLES / "healthy_fp16.sqlite"))
    assert all(f.severity == "info" for f in findings), serious(findings)


def test_sample_bf16_noscaler_is_healthy():
    assert serious(ampwatch.diagnose(str(SAMPLES / "bf16_noscaler.sqlite"))) == []


def test_sample_overflow_storm_names_the_overflow_and_its_origin():
    findings = ampwatch.diagnose(str(SAMPLES / "overflow_storm.sqlite"))
    (module, n), = _sql("overflow_storm", "SELECT module, COUNT(DISTINCT step) AS n FROM events WHERE origin = 1 "
                                          "AND phase = 'forward' GROUP BY module ORDER BY n DESC LIMIT 1")
    (first,), = _sql("overflow_storm", "SELECT MIN(step) FROM events WHERE origin = 1 AND phase = 'forward'")
    overflow = [f for f in findings if f.id in ("scale-collapse", "recurring-overflow")]
    assert overflow and all(module in f.evidence for f in overflow)
    origin = the(findings, "nonfinite-origin")
    assert origin.steps[0] == first and f"born in {module} (" in origin.title
    assert "warmup-skips" in ids(findings, "info")  # init_scale 2**24: the start is normal
    assert "divergence" not in ids(findings)  # it recovered


def test_a_single_skipped_step_is_named_as_one():
    """healthy_fp16 skipped its first step only in warm-up: "step 0", not "steps 0" or "1 ... step(s)";
    a finding over several steps lists them after "steps"."""
    findings = ampwatch.diagnose(str(SAMPLES / "healthy_fp16.sqlite"))
    skipped = [s for (s,) in _sql("healthy_fp16", "SELECT step FROM steps WHERE skipped = 1 ORDER BY step")]
    warm = the(findings, "warmup-skips")
    assert skipped[0] == 0 and skipped[1] > 1  # one warm-up skip, then a clean step
    assert warm.steps == (0, 0) and "step 0, the first, skipped" in warm.title
    assert warm.evidence.startswith("step 0, the first step, skipped;")
    late = the(findings, "late-skips")
    assert late.evidence.startswith("steps " + ", ".join(f"{s:,}" for s in skipped[1:]) + " (")
    for f in findings:
        assert not re.search(r"\bsteps \d+(?:,\d{3})*(?!\d|,\d|, |-| to | and)", f.evidence), f.evidence


def test_sample_diverged_names_the_origin_and_the_divergence():
    findings = ampwatch.diagnose(str(SAMPLES / "diverged.sqlite"))
    (step, module, phase), = _sql("diverged", "SELECT step, module, phase FROM events WHERE origin = 1 "
                                              "ORDER BY step, id LIMIT 1")
    origin = the(findings, "nonfinite-origin")
    assert origin.severity == "error" and origin.steps[0] == step and f"born in {module} (" in origin.title
    assert phase in origin.title
    losses = _sql("diverged", "SELECT step, loss, nan_mask & 1 FROM steps ORDER BY step")
    last_good = max(s for s, loss, nan in losses if loss is not None and not nan and abs(loss) != float("inf"))
    div = the(findings, "divergence")
    assert div.severity == "error" and div.steps == (last_good + 1, losses[-1][0])
    assert module in div.evidence
    norms = _sql("diverged", f"SELECT t.name, l.step, l.param_norm FROM layers l JOIN tensors t ON t.id = l.param_id "
                             f"WHERE t.name LIKE '{module}.%' AND l.step <= {step} ORDER BY t.name, l.step")
    jumped = {n for n, (a, b) in ((n, [r[2] for r in norms if r[0] == n][-2:]) for n, _, _ in norms)
              if a and b and b >= rules.WEIGHT_JUMP * a}
    assert jumped  # the sample multiplies a weight by 1e5 at the divergence
    for name in jumped:  # ... and the doctor must say it was overwritten
        assert f"the norm of {name} jumped" in origin.evidence and "overwrote" in origin.advice
    assert findings[0].severity == "error" and findings[0].id == "nonfinite-origin"  # root cause first


# -- output: Finding, report, CLI --------------------------------------------------------------------

def test_findings_are_sorted_and_serialisable(runs):
    _, findings = runs("collapse")
    order = [("error", "warning", "info").index(f.severity) for f in findings if f.cause is None]
    assert order == sorted(order)  # roots by severity, each followed by its consequences
    ids_so_far = set()
    for f in findings:
        assert f.cause is None or f.cause in ids_so_far  # a consequence comes after its root
        ids_so_far.add(f.id)
    d = findings[0].to_dict()
    assert set(d) == {"id", "severity", "title", "steps", "evidence", "advice", "jump", "cause"}
    assert json.loads(json.dumps(d)) == d
    for f in findings:
        assert f.jump[0] <= f.steps[0] and f.jump[0] <= f.jump[1]
    assert ampwatch.Finding is Finding


def test_report_lists_every_finding(runs):
    run, findings = runs("stuck")
    text = format_report(run, findings)
    assert text.splitlines()[0].startswith(run.name)
    for f in findings:
        assert f"{f.severity.upper():<8}{f.id}" in text


def test_cli_exit_status_follows_severity():
    runner = CliRunner()
    assert runner.invoke(cli, ["doctor", str(SAMPLES / "healthy_fp16.sqlite")]).exit_code == 0
    bad = runner.invoke(cli, ["doctor", str(SAMPLES / "diverged.sqlite")])
    assert bad.exit_code == 1 and "ERROR   nonfinite-origin" in bad.output
    never = runner.invoke(cli, ["doctor", str(SAMPLES / "diverged.sqlite"), "--fail-on", "never"])
    assert never.exit_code == 0


def test_cli_warning_gate(runs):
    run, _ = runs("headroom")
    assert CliRunner().invoke(cli, ["doctor", str(run.path)]).exit_code == 0
    assert CliRunner().invoke(cli, ["doctor", str(run.path), "--fail-on", "warning"]).exit_code == 1


def test_cli_json_single_run_matches_diagnose():
    path = SAMPLES / "diverged.sqlite"
    result = CliRunner().invoke(cli, ["doctor", str(path), "--json"])
    payload = json.loads(result.output)
    assert payload["run"] == "diverged"
    findings = ampwatch.diagnose(str(path))
    assert payload["findings"] == [f.to_dict() for f in findings]
    roots = [f for f in findings if f.cause is None]
    assert [c["id"] for c in payload["causes"]] == [f.id for f in roots]
    assert [c["id"] for c in payload["causes"][0]["consequences"]] == [f.id for f in findings if f.cause == roots[0].id]
    assert payload["health"] == f"error: {roots[0].title}"


def test_cli_folder_gives_one_report_per_run_and_flags_unreadable(tmp_path):
    names = sorted(p.stem for p in SAMPLES.glob("*.sqlite"))
    for name in names:
        (tmp_path / f"{name}.sqlite").write_bytes((SAMPLES / f"{name}.sqlite").read_bytes())
    result = CliRunner().invoke(cli, ["doctor", str(tmp_path), "--json"])
    assert result.exit_code == 1  # diverged has errors
    assert [r["run"] for r in json.loads(result.output)] == names
    text = CliRunner().invoke(cli, ["doctor", str(tmp_path)])
    assert sum(line.startswith(tuple(f"{n}  (" for n in names)) for line in text.output.splitlines()) == len(names)
    head = text.output.splitlines()[:len(names)]  # one health line per run first
    assert [line.split()[0] for line in head] == names
    for line, name in zip(head, names):
        findings = ampwatch.diagnose(str(tmp_path / f"{name}.sqlite"))
        assert line.split(None, 1)[1] == ("ok" if all(f.severity == "info" for f in findings)
                                          else f"{findings[0].severity}: {findings[0].title}")
    (tmp_path / "broken.sqlite").write_text("not a run")
    result = CliRunner().invoke(cli, ["doctor", str(tmp_path), "--json"])
    assert result.exit_code == 2 and len(json.loads(result.stdout)) == len(names)
    assert "broken.sqlite" in result.stderr and result.stderr.count("\n") == 1


def test_cli_unreadable_input_is_one_line_exit_2(tmp_path):
    junk = tmp_path / "junk.sqlite"
    junk.write_text("nope")
    for target in (junk, tmp_path / "missing.sqlite"):
        result = CliRunner().invoke(cli, ["doctor", str(target)])
        assert result.exit_code == 2 and result.output.count("\n") == 1


def test_diagnosis_leaves_the_file_untouched_and_needs_no_torch(tmp_path):
    import subprocess
    import sys
    copy = tmp_path / "storm.sqlite"
    copy.write_bytes((SAMPLES / "overflow_storm.sqlite").read_bytes())
    before = copy.read_bytes()
    code = ("import sys, ampwatch; fs = ampwatch.diagnose(sys.argv[1]); "
            "assert 'torch' not in sys.modules, 'doctor imported torch'; print(len(fs))")
    out = subprocess.run([sys.executable, "-c", code, str(copy)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) > 0 and copy.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["storm.sqlite"]  # no -wal/-shm left behind


# -- the narrow queries behind the doctor agree with the reader's whole tables --------------------------

@pytest.mark.parametrize("name", ["stuck", "headroom", "recurring"])
def test_facts_queries_agree_with_the_whole_tables(runs, name):
    """Facts asks SQLite narrow questions instead of loading the detail tables; the reader's whole
    tables, filtered in pandas the way the rules used to, are the ground truth."""
    import numpy as np
    import pandas as pd
    from ampwatch.doctor.facts import Facts
    run, _ = runs(name)
    layers, mods = run.layers, run.modules
    scale = run.steps.set_index("step")["loss_scale"]
    with Facts.open(run) as facts:
        last = facts.last_step
        for first, end in ((0, last), (last // 3, 2 * last // 3), (5, 5)):
            rows = layers[layers["step"].between(first, end)]
            scaled = (rows["grad_amax"] * rows["step"].map(scale)).to_numpy(dtype=float)
            back = mods.loc[(mods["phase"] == "backward") & mods["step"].between(first, end), "amax"]
            values = np.concatenate([scaled, back.to_numpy(dtype=float)])
            values = values[np.isfinite(values)]
            peak = float(values.max()) if len(values) else None
            assert facts.scaled_grad_max(first, end) == peak, (first, end)
            if peak:
                assert facts.scaled_grad_max(first, end, stop_above=peak / 2) > peak / 2
                assert facts.scaled_grad_max(first, end, stop_above=peak) == peak  # none above: the exact max
        measured = layers[np.isfinite(layers["grad_amax"]) & layers["grad_zero_frac"].notna()]
        pd.testing.assert_frame_equal(facts.measured_grads(None, last, set(layers["name"])),
                                      measured[["name", "step", "grad_amax", "grad_zero_frac"]].reset_index(drop=True))
        fwd = mods[(mods["phase"] == "forward") & ~mods["nonfinite"]]
        pd.testing.assert_frame_equal(facts.forward_activations(last, set(fwd["module"])),
                                      fwd[["module", "step", "amax"]].reset_index(drop=True))
        prefix = layers["name"].iloc[0].rsplit(".", 1)[0] + "."  # a module's parameters
        rows = layers[layers["name"].str.startswith(prefix) & (layers["step"] <= last // 2)
                      & layers["grad_zero_frac"].notna()]
        norms = {n: list(zip(g["step"].tail(2), g["param_norm"].tail(2))) for n, g in rows.groupby("name")}
        assert norms and facts.last_param_norms(prefix, last // 2) == norms
