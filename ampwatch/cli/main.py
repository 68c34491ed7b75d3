"""The `ampwatch` command line. Thin: parse, call the library, print. Bad input: one line, exit 2."""
from __future__ import annotations

import json
import math
import re
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import click

from ..errors import DashboardError, OutputError, RunError


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.{digits}g}"
    return str(value)


def _load(path: str):
    from ..store.reader import Run
    return Run(path)


def _output_folder(out: str) -> Path:
    """``out``, created if missing and proved writable (one throwaway file), else one OutputError
    line: checked before any work, so a bad --out costs nothing and leaves nothing half-written."""
    if not out:  # Path("") would be the current folder
        raise OutputError("--out is empty: pass the folder to write into (it is created if missing)")
    target = Path(out)
    if target.exists() and not target.is_dir():
        raise OutputError(f"--out {out!r} is a file, not a folder: pass a folder (it is created if missing)")
    try:
        target.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=target).close()
    except OSError as exc:
        raise OutputError(f"cannot write into --out {out!r} ({exc.strerror or exc}): "
                          "pass a folder you can write to") from None
    return target


_NO_ARGS = getattr(click.exceptions, "NoArgsIsHelpError", ())  # click >= 8.2


def _usage_line(exc: click.UsageError) -> None:
    """A mistyped command line (an unknown option or command, a missing argument) as one line on
    stderr, exit 2: what is wrong and where to look, instead of click's usage block."""
    if isinstance(exc, _NO_ARGS) and exc.ctx is not None:  # a bare ``ampwatch``: its help, as any tool
        click.echo(exc.ctx.get_help())
        sys.exit(0)
    command = exc.ctx.command_path if exc.ctx is not None else "ampwatch"
    click.echo(f"{command}: {exc.format_message()} See '{command} --help'.", err=True)
    sys.exit(exc.exit_code)


class _Group(click.Group):
    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        try:  # the group's own options (``ampwatch --bogus``) are parsed here
            return super().make_context(*args, **kwargs)
        except click.UsageError as exc:
            _usage_line(exc)
            raise  # not reached

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (RunError, OutputError, DashboardError) as exc:  # the one-line contract for bad input
            click.echo(f"ampwatch: {exc}", err=True)
            ctx.exit(2)
        except click.UsageError as exc:  # a command's options and arguments, or no such command
            _usage_line(exc)


@click.group(cls=_Group)
@click.version_option(package_name="ampwatch")
def cli() -> None:
    """ampwatch: look inside mixed-precision training runs.

    \b
    Example:
        ampwatch summary runs/exp1.sqlite
    """


@cli.command()
@click.argument("path")
def summary(path: str) -> None:
    """Headline figures of one run: steps, skips, loss, scale, grad norms.

    PATH may be a folder: the rank files of a distributed job are reported once, as a job (figures
    across ranks, per-rank lines where the ranks differ); other runs one by one.

    \b
    Example:
        ampwatch summary sample_runs/overflow_storm.sqlite
        ampwatch summary runs/ddp_job/
    """
    from ..doctor.summary import summarize
    if not Path(path).is_dir():
        run = _load(path)
        click.echo(_summary_text(summarize(run), run.path.name))
        return
    from ..jobs.group import load_groups
    from .job_report import format_job_summary
    status, blocks = 0, []
    for group in load_groups(path):
        if not group.paths:  # a file that is no run and belongs to no job
            status = 2
            for u in group.unreadable:
                click.echo(f"ampwatch: {u.reason}", err=True)
            continue
        status = 2 if group.unreadable else status
        if group.world_size > 1 or len(group.paths) > 1:
            blocks.append(format_job_summary(group))  # names its unreadable rank files itself
        else:
            for u in group.unreadable:  # the other runs are still summarised
                click.echo(f"ampwatch: {u.reason}", err=True)
            run = _load(str(next(iter(group.paths.values()))))
            blocks.append(_summary_text(summarize(run), run.path.name))
    click.echo("\n\n".join(blocks))
    sys.exit(status)


def _summary_text(s: dict, file: str) -> str:
    """``file``: the run file's name; a run's name need not be its file's (a renamed copy)."""
    from .report import numbered
    return "\n".join([
        f"run      {s['name']}  ({s['status']}, {s['amp_dtype'] or 'no autocast seen'}, {s['device']})  file {file}",
        f"steps    {s['steps']}{numbered(s.get('first_step'), s.get('last_step'))}  skipped {s['skipped']} ({s['skipped_pct']:.1f}%)"
        + (f"; {s['unfinished_text']}" if s.get("unfinished_text") else ""),
        f"loss     first {_fmt(s['loss_first'])}  last {_fmt(s['loss_last'])}  min {_fmt(s['loss_min'])}",
        f"scale    start {_fmt(s['scale_start'])}  min {_fmt(s['scale_min'])}  final {_fmt(s['scale_final'])}",
        _nonfinite_line(s),
        f"gradnorm p50 {_fmt(s['grad_norm_p50'])}  p90 {_fmt(s['grad_norm_p90'])}  "
        f"p99 {_fmt(s['grad_norm_p99'])}  max {_fmt(s['grad_norm_max'])}"]
        + _memory_lines(s)
        + ([f"recorder {s['detail_cost']}"] if s.get("detail_cost") else [])
        + [f"{'crashed' if i == 0 else '':<8} {line}" for i, line in enumerate(s.get("error_tail") or [])])


def _nonfinite_line(s: dict) -> str:
    if s["first_nonfinite_step"] is None:
        return "nonfinite none"
    loss = s["first_nonfinite_loss_step"]
    unknown = (f"; step {s['unfinished_step']}'s was not recorded"
               if s.get("unfinished_step") is not None and not s.get("unfinished_loss") else "")
    return (f"nonfinite first at step {s['first_nonfinite_step']}  "
            + (f"(loss first NaN/inf at step {loss})" if loss is not None else
               "(no loss recorded: watch.log(loss=loss) records it)" if s["loss_first"] is None and s["loss_last"] is None
               else f"(the loss stayed finite{unknown})"))


def _memory_lines(s: dict) -> list[str]:
    """``memory   host 398 MiB -> 711 MiB (max 720 MiB)``, where the run read its memory."""
    from ..doctor.finding import size_text
    parts = [f"{label} {size_text(s[key + '_first'])} -> {size_text(s[key + '_last'])} (max {size_text(s[key + '_max'])})"
             for key, label in (("host_rss", "host"), ("device_allocated", "device")) if s.get(key + "_first") is not None]
    return [f"memory   {'  '.join(parts)}"] if parts else []



@cli.command(name="ls")
@click.argument("folder", default="runs")
def ls_(folder: str) -> None:
    """One line per run in FOLDER (default: runs): name, status, steps, skipped %, last loss, health.

    Health is the doctor's verdict: the worst severity and the first root cause's headline, or "ok"
    when nothing is above info.

    \b
    Example:
        ampwatch ls sample_runs
    """
    from ..doctor import diagnose, health
    from ..store.reader import find_runs
    from ..doctor.summary import summarize
    paths = find_runs(folder)
    click.echo(f"{'name':<28} {'status':<12} {'steps':>8} {'skipped%':>9} {'last loss':>10}  health")
    for path in paths:
        try:
            run = _load(str(path))
            s = summarize(run)
            verdict = health(diagnose(run))
        except RunError as exc:
            click.echo(f"{path.name:<28} unreadable: {exc}")
            continue
        # a renamed copy keeps its run's name: say which file it is
        name = s["name"] if path.stem == s["name"] else f"{s['name']} ({path.name})"
        click.echo(f"{name:<28} {s['status']:<12} {s['steps']:>8} {s['skipped_pct']:>9.1f} "
                   f"{_fmt(s['loss_last']):>10}  {verdict}")


@cli.command()
@click.argument("path")
@click.option("--format", "fmt", type=click.Choice(["csv", "parquet"]), default="csv", show_default=True)
@click.option("--to", "to", type=click.Choice(["tensorboard", "mlflow", "wandb"]), default=None,
              help="write into a tracker instead: AMP series under amp/ at their true steps, findings as text "
                   "(PATH may be a folder of runs)")
@click.option("--out", "out", help="folder to write into (created if missing); with --to tensorboard: the log "
                                   "folder (one subfolder per run); required except for --to mlflow/wandb")
def export(path: str, fmt: str, to: Optional[str], out: Optional[str]) -> None:
    """Write a run's steps, layers, modules, events and metrics as CSV or Parquet files, or
    (--to) into TensorBoard, MLflow or Weights & Biases.

    MLflow uses MLFLOW_TRACKING_URI (and MLFLOW_EXPERIMENT_NAME); W&B its own environment
    (WANDB_PROJECT, WANDB_MODE=offline, ...).

    \b
    Example:
        ampwatch export runs/exp1.sqlite --format csv --out exported/
        ampwatch export runs/ --to tensorboard --out tb_logs/
        MLFLOW_TRACKING_URI=http://localhost:5000 ampwatch export runs/exp1.sqlite --to mlflow
    """
    if to is not None:
        if click.get_current_context().get_parameter_source("fmt").name == "COMMANDLINE":
            raise click.UsageError("--format is for files; --to writes into a tracker: pass one of them")
        from ..trackers.export import export_paths
        status = 0
        for ok, line in export_paths(path, to, out, _output_folder):
            click.echo(line if ok else f"ampwatch: {line}", err=not ok)
            status = status if ok else 2
        sys.exit(status)
    if out is None:
        raise click.UsageError("Missing option '--out'.")
    from ..store.reader import EXPORTED_TABLES
    run = _load(path)
    target = _output_folder(out)
    if fmt == "parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise click.ClickException("parquet export needs pyarrow: pip install 'ampwatch[parquet]'")
    # the name comes from the file: keep it a plain file name (no '/', '..' or control bytes)
    stem = re.sub(r"[^\w.-]", "_", run.name).lstrip(".") or "run"
    for table in EXPORTED_TABLES:
        df = run.exported(table)  # NaN apart from NULL: CSV 'nan' and an empty cell, Parquet NaN and null
        file = target / f"{stem}_{table}.{fmt}"
        try:
            if fmt == "csv":
                df.to_csv(file, index=False)  # inf and -inf as 'inf' and '-inf'
            else:
                _write_parquet(df, file)
        except OSError as exc:  # a folder in the file's place, a full disk
            raise OutputError(f"cannot write {str(file)!r} ({exc.strerror or exc}): "
                              "pass another --out folder, or make room for the file there") from None
        click.echo(f"wrote {file} ({len(df)} rows)")


@cli.command()
@click.argument("path")
@click.option("--step", "step", type=int, default=None, help="the step whose saved inputs to write (default: list them)")
@click.option("--micro-batch", "micro_batch", type=int, default=None,
              help="which micro-batch of the step (default: the first saved)")
@click.option("--out", "out", default=None, help="a new .pt file: a dict of tensors by name, for torch.load(FILE, "
                                                 "weights_only=True)")
def batch(path: str, step: Optional[int], micro_batch: Optional[int], out: Optional[str]) -> None:
    """List the model inputs a run saved (from the first steps whose loss or outputs went NaN/Inf,
    and the step a crash stopped), or write one step's to a file to reproduce it.

    \b
    Example:
        ampwatch batch runs/exp1.sqlite
        ampwatch batch runs/exp1.sqlite --step 180 --out step180.pt
    """
    run = _load(path)
    if step is None:
        if out is not None or micro_batch is not None:
            raise click.UsageError("--out and --micro-batch need --step: which step's inputs to write.")
        click.echo(_batches_text(run.batches, run.path.name))
        return
    if out is None:
        raise click.UsageError("--step needs --out: the .pt file to write the step's inputs into.")
    target = Path(out)
    if target.exists():
        raise OutputError(f"--out {out!r} exists: pass a new file name (nothing is overwritten)")
    if not target.parent.is_dir():
        raise OutputError(f"cannot write {out!r}: the folder {str(target.parent)!r} does not exist; pass a file "
                          "in a folder you can write to")
    import torch
    from .. import load_batch
    tensors = load_batch(run, step, micro_batch)  # RunError: none saved for that step
    try:
        torch.save(tensors, target)
    except (OSError, RuntimeError) as exc:  # torch.save's own writer raises RuntimeError
        target.unlink(missing_ok=True)
        raise OutputError(f"cannot write {out!r} ({getattr(exc, 'strerror', None) or exc}): pass a file in a "
                          "folder you can write to") from None
    listed = run.batches.query("step == @step")  # names only: the bytes were read once, above
    mb = micro_batch if micro_batch is not None else int(listed["micro_batch"].min())
    left = int((listed["micro_batch"] == mb).sum()) - len(tensors)
    click.echo(f"wrote {out}: step {step} micro-batch {mb}, {len(tensors)} tensor{'s' if len(tensors) != 1 else ''}"
               + (f" ({left} listed but not saved: over the budget)" if left else "")
               + "; load with torch.load(FILE, weights_only=True)")


def _batches_text(df: Any, file: str) -> str:
    if df.empty:
        return (f"{file}: no inputs saved (they are saved for the first steps whose loss or outputs went "
                "NaN/Inf, and the step a crash stopped)")
    lines = [f"{'step':>6}  {'mb':>3}  {'name':<24} {'dtype':<9} {'shape':<16} {'bytes':>10}  sha256"]
    for r in df.itertuples(index=False):
        shape = "[" + ", ".join(map(str, r.shape)) + "]"
        digest = r.sha256[:16] if r.saved else "(not saved: over the budget)"
        lines.append(f"{r.step:>6}  {r.micro_batch:>3}  {r.name:<24} {r.dtype:<9} {shape:<16} {r.nbytes:>10,}  {digest}")
    return "\n".join(lines)


def _write_parquet(df: Any, file: Path) -> None:
    """``df`` as Parquet, its nullable ``Float64`` columns (a NaN kept apart from NULL) as doubles
    holding NaN and null, which pandas reads back as float64 (both NaN), as it read them before."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    table = pa.Table.from_pandas(df, preserve_index=False)
    meta = json.loads(table.schema.metadata[b"pandas"])
    for column in meta["columns"]:
        if column.get("numpy_type") == "Float64":
            column["numpy_type"] = "float64"
    pq.write_table(table.replace_schema_metadata({**table.schema.metadata, b"pandas": json.dumps(meta).encode()}),
                   file)


@cli.command()
@click.option("--out", default="sample_runs", show_default=True, help="folder to write into (created if missing)")
@click.option("--only", multiple=True, help="regenerate only these samples")
def demo(out: str, only: tuple) -> None:
    """Regenerate the sample runs: real CPU training recorded by ampwatch (about a minute).

    \b
    Example:
        ampwatch demo --out sample_runs
    """
    target = _output_folder(out)  # before importing torch: a bad --out answers at once
    from ..samples.demo import SAMPLES, make_samples, total_steps
    names = list(only) or None
    unknown = [n for n in only if n not in SAMPLES]
    if unknown:
        raise click.BadParameter(f"unknown sample {unknown[0]!r}; choose from {', '.join(SAMPLES)}")
    folders = [n for n in names or SAMPLES if (target / f"{n}.sqlite").is_dir()]
    if folders:
        where = str(target / f"{folders[0]}.sqlite")
        raise OutputError(f"{where!r} is a folder, not a run file: move it away, or pass another --out")
    with click.progressbar(length=total_steps(names), label="training sample runs") as bar:
        written = make_samples(target, names, progress=bar.update)
    for path in written:
        click.echo(f"wrote {path}")


@cli.command()
@click.argument("folder", default="runs")
@click.option("--port", default=None, metavar="N", help="port to serve on  [default: 8501, or the next free one]")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="address to listen on (0.0.0.0: every interface, so other machines can connect)")
def dashboard(folder: str, port: Optional[str], host: str) -> None:
    """Start the dashboard on the runs in FOLDER (default: runs) and print its address.

    It listens on this machine only (127.0.0.1) unless --host says otherwise, and sends no usage
    statistics, whatever folder you start it from. Needs the dashboard extra:
    pip install 'ampwatch[dashboard]'. Stop it with Ctrl-C.

    \b
    Example:
        ampwatch dashboard sample_runs --port 8502
    """
    from ..dashboard.launch import start
    start(folder, port, host)  # replaces this process with Streamlit


@cli.command()
@click.argument("path")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--fail-on", type=click.Choice(["error", "warning", "never"]), default="error", show_default=True,
              help="lowest severity that makes the exit status 1")
def doctor(path: str, as_json: bool, fail_on: str) -> None:
    """Diagnose a run (or every run in a folder): findings with evidence and advice.

    In a folder, the rank files of a distributed job are diagnosed together and reported once:
    which rank's batch went non-finite first, then the per-rank findings, each once with its ranks.

    Exit status: 0 no finding at --fail-on severity (default: error), 1 at least one,
    2 unreadable input (in a folder: any unreadable run).

    \b
    Example:
        ampwatch doctor sample_runs/diverged.sqlite
        ampwatch doctor sample_runs --json
    """
    from ..doctor import SEVERITIES, health
    failing = set() if fail_on == "never" else set(SEVERITIES[:SEVERITIES.index(fail_on) + 1])
    if Path(path).is_dir():
        _doctor_folder(path, as_json, failing)
    from ..doctor import diagnose
    from .report import format_report
    run = _load(path)
    findings = diagnose(run)
    status = 1 if any(f.severity in failing for f in findings) else 0
    if as_json:
        click.echo(json.dumps(_json_report(run, findings, health(findings)), indent=2))
    else:
        click.echo(format_report(run, findings))
    sys.exit(status)


def _doctor_folder(path: str, as_json: bool, failing: set) -> None:
    """Every run in a folder; the rank files of a job are diagnosed together and reported once."""
    from ..doctor import diagnose, health
    from .report import format_report, health_line
    from ..jobs.group import load_groups
    from ..doctor.job import diagnose_group, diagnose_ranks
    from .job_report import format_job_doctor, job_doctor_json
    texts, payload, heads, status = [], [], [], 0
    for group in load_groups(path):
        for u in group.unreadable:  # the other runs are still diagnosed
            click.echo(f"ampwatch: {u.reason}", err=True)
            status = 2
        if not group.paths:
            continue
        try:
            if group.world_size > 1 or len(group.paths) > 1:
                job = diagnose_group(group)
                per_rank = diagnose_ranks(group, job)
                findings = job + [f for f, _ in per_rank]
                heads.append(f"{group.name:<28} {health(findings)}")
                texts.append(format_job_doctor(group, job, per_rank))
                payload.append(dict(job_doctor_json(group, job, per_rank), health=health(findings)))
            else:
                run = _load(str(next(iter(group.paths.values()))))
                findings = diagnose(run)
                heads.append(health_line(run, findings))
                texts.append(format_report(run, findings))
                payload.append(_json_report(run, findings, health(findings)))
        except RunError as exc:
            click.echo(f"ampwatch: {exc}", err=True)
            status = 2
            continue
        if any(f.severity in failing for f in findings):
            status = max(status, 1)
    head = "\n".join(heads) + "\n\n" if heads else ""
    click.echo(json.dumps(payload, indent=2) if as_json else head + ("\n\n" + "-" * 100 + "\n").join(texts))
    sys.exit(status)


@cli.command()
@click.argument("run_a")
@click.argument("run_b")
@click.option("--rtol", type=click.FloatRange(min=0), default=None,
              help="relative tolerance for loss, norms and maxima (default: ten units in the last place of "
                   "the coarser dtype: 0.0098 for float16, 0.078 for bfloat16, 1e-4 for float32)")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def diff(run_a: str, run_b: str, rtol: Optional[float], as_json: bool) -> None:
    """Where two runs part: the first step, layer and module whose recorded figures differ beyond
    a tolerance, how far apart, and the settings that differ (dtype, scaler, torch, config).

    Steps are aligned by number; runs of different dtypes or lengths are compared on what they
    share. Exit status: 0 no figure parts, 1 the runs part, 2 unreadable input or no shared step.

    \b
    Example:
        ampwatch diff runs/eager.sqlite runs/compiled.sqlite
        ampwatch diff sample_runs/healthy_fp16.sqlite sample_runs/bf16_noscaler.sqlite --json
    """
    from ..doctor.diff import diff_runs
    from .diff_report import format_diff
    result = diff_runs(_load(run_a), _load(run_b), rtol=rtol)
    if not result.steps_shared:
        raise RunError(f"{run_a!r} and {run_b!r} share no recorded step: nothing to compare "
                       "(steps are aligned by number)")
    click.echo(json.dumps(result.to_dict(), indent=2) if as_json else format_diff(result))
    sys.exit(1 if result.parted else 0)


def _json_report(run: Any, findings: list, verdict: str) -> dict:
    """``findings``: the flat list in report order (each with ``cause``); ``causes``: the same
    findings as a tree, each root with its ``consequences``."""
    flat = [f.to_dict() for f in findings]
    causes = [dict(f, consequences=[c for c in flat if c["cause"] == f["id"]]) for f in flat if f["cause"] is None]
    return {"run": run.name, "path": str(run.path), "health": verdict, "findings": flat, "causes": causes}


def main(argv: Optional[list] = None) -> None:
    cli.main(args=argv, prog_name="ampwatch")


if __name__ == "__main__":
    main()
