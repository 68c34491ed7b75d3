"""Damaged run files. Seeded damage (bit flips in the header and in table pages, truncation,
zeroed 4 KiB pages, garbage runs, a WAL flag without its -wal) of two real runs; every reader and every
CLI command must answer with a RunError / one line on stderr and exit 2, or read the file; never another
exception, never a traceback, never a changed or new file."""
from __future__ import annotations

import hashlib
import importlib.util
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from click.testing import CliRunner

import ampwatch
from ampwatch.dashboard import rundata
from ampwatch.dashboard import layerdata
from ampwatch.cli.main import cli
from ampwatch.errors import RunError
from ampwatch.doctor.diff import diff_runs
from ampwatch.doctor.summary import summarize
from helpers.loops import amp_step, data, mlp

ROOT = Path(__file__).resolve().parent.parent
COPIES = 300  # 60 of each kind of damage
SUBPROCESS_EVERY = 50  # real `python -m ampwatch` processes for every 50th copy (the rest in-process)
KINDS = ("header", "flip", "truncate", "zero-page", "garbage")


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> list[Path]:
    """The committed overflow_storm sample (TinyGPT: origins, skips, 72 pages) and a fresh MLP run
    with logged metrics and non-ASCII text (a flipped byte in it is invalid UTF-8)."""
    folder = tmp_path_factory.mktemp("fuzz-src")
    storm = folder / "storm.sqlite"
    shutil.copy(ROOT / "sample_runs" / "overflow_storm.sqlite", storm)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)  # warm-up skips: events, detail rows
    with ampwatch.attach(model, opt, scaler, path=str(folder / "mlp.sqlite"), name="überlauf-✓",
                         config={"note": "größe ✓ 数"}, layer_every=3) as watch:
        for i in range(60):
            amp_step(model, opt, scaler, *data(i % 5))
            watch.log(accuracy=i / 60, grad_norm_ratio=1.0)
    return [storm, watch.path]


def damage(raw: bytes, kind: str, rng: random.Random) -> bytes:
    b = bytearray(raw)
    pages = len(b) // 4096
    if kind == "header":  # the 100-byte file header; every 10th also claims WAL mode (bytes 18/19)
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(100)
            b[i] ^= 1 << rng.randrange(8)
        if rng.random() < 0.1:
            b[18] = b[19] = 2
    elif kind == "flip":  # inside table pages
        for _ in range(rng.randint(1, 16)):
            i = rng.randrange(4096, len(b))
            b[i] ^= 1 << rng.randrange(8)
    elif kind == "truncate":
        cut = rng.randrange(1, pages) * 4096 if rng.random() < 0.5 else rng.randrange(1, len(b))
        del b[cut:]
    elif kind == "zero-page":
        p = rng.randrange(pages)
        b[p * 4096:(p + 1) * 4096] = bytes(4096)
    else:  # a run of garbage inside one page
        n = rng.randint(16, 256)
        at = rng.randrange(len(b) - n)
        b[at:at + n] = bytes(rng.randrange(256) for _ in range(n))
    return bytes(b)


def _readers(path: Path, k: int) -> dict[str, Callable[[], Any]]:
    """Every reader that is cheap on each copy; the costly ones (a few hundred ms each) take turns."""
    run: list = []

    def opened() -> Any:  # one Run per copy, as a user would hold it: each table read once
        if not run:
            run.append(ampwatch.load(path))
        return run[0]
    readers = {
        "load": opened, "info": lambda: opened().info, "name": lambda: opened().name,
        "steps": lambda: opened().steps, "layers": lambda: opened().layers, "modules": lambda: opened().modules,
        "events": lambda: opened().events, "metrics": lambda: opened().metrics, "notices": lambda: opened().notices,
        "tensors": lambda: opened().tensors, "query": lambda: opened().query("SELECT * FROM steps WHERE step >= ?", (10,)),
        "run_row": lambda: rundata.run_row(path), "overview": lambda: rundata.overview_data(path, buckets=50),
        "skip_rate": lambda: rundata.skip_rate(path), "dash_events": lambda: rundata.events(path),
        "step_detail": lambda: rundata.step_detail(path, 24), "heatmap": lambda: layerdata.layer_heatmap(path),
        "zero_grads": lambda: layerdata.zero_grad_fraction(path),
    }
    good = ROOT / "sample_runs" / "healthy_fp16.sqlite"  # beside a sound run, the damaged one is named
    costly = {"summarize": lambda: summarize(ampwatch.load(path)), "diagnose": lambda: ampwatch.diagnose(str(path)),
              "headroom": lambda: layerdata.module_headroom(path), "diff": lambda: diff_runs(path, good),
              "diff_b": lambda: diff_runs(good, path)}
    name = sorted(costly)[k % len(costly)]
    readers[name] = costly[name]
    return readers


def _cli_command(path: Path, out: Path, k: int) -> list[str]:
    """Each copy gets one command in-process (they take turns); ``ls`` reads every copy at the end."""
    commands = [["summary", str(path)], ["doctor", str(path)], ["doctor", "--json", str(path)],
                ["export", str(path), "--format", "csv", "--out", str(out)]]
    return commands[k % len(commands)]


def _loaders_module():
    from streamlit import logger
    logger.set_log_level("error")  # its cache outside an app logs "missing ScriptRunContext" on every call
    if str(ROOT / "app") not in sys.path:  # as Streamlit runs the app: its modules are top-level (diagnoses)
        sys.path.insert(0, str(ROOT / "app"))
    spec = importlib.util.spec_from_file_location("app_loaders_fuzz", ROOT / "app" / "loaders.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _app_loaders(loaders: Any, path: Path) -> dict[str, Callable[[], Any]]:
    key, p = loaders.stamp(path), str(path)
    return {"app.run_row": lambda: loaders.run_row(p, key), "app.overview": lambda: loaders.overview(p, key),
            "app.heatmap": lambda: loaders.heatmap(p, key, "grad_norm", None, None),
            "app.headroom": lambda: loaders.headroom(p, key, None, None),
            "app.zero_grads": lambda: loaders.zero_grads(p, key, None, None), "app.events": lambda: loaders.events(p, key),
            "app.step_detail": lambda: loaders.step_detail(p, key, 24), "app.skip_rate": lambda: loaders.skip_rate(p, key),
            "app.findings": lambda: loaders.findings(p, key)}


def _one_line_about(message: str, path: Path) -> bool:
    return "\n" not in message.strip() and str(path) in message


@pytest.mark.filterwarnings("ignore")  # streamlit's bare-mode notes and pandas' on odd (damaged) values
def test_damaged_copies_give_run_error_or_data_never_anything_else(sources, tmp_path):
    rng = random.Random(20261123)
    loaders = _loaders_module()
    unexpected: list[str] = []
    counts = {"copies": 0, "RunError": 0, "read": 0, "cli": 0, "subprocess": 0, "partial": 0}
    folder = tmp_path / "copies"
    folder.mkdir()
    for k in range(COPIES):
        source, kind = sources[k % 3 == 2], KINDS[k % len(KINDS)]
        path = folder / f"c{k:03d}-{kind}.sqlite"
        path.write_bytes(damage(source.read_bytes(), kind, rng))
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        counts["copies"] += 1
        failed = set()
        readers = _readers(path, k)
        if k % 6 == 0:  # the dashboard's cached loaders (thin wrappers of the functions above) on a sixth
            readers.update(_app_loaders(loaders, path))
        for name, read in readers.items():
            try:
                read()
                counts["read"] += 1
            except RunError as exc:
                counts["RunError"] += 1
                failed.add(name)
                if not _one_line_about(str(exc), path):
                    unexpected.append(f"{path.name} {name}: RunError not one line naming the file: {exc}")
            except Exception as exc:  # noqa: BLE001 - the test's whole point
                unexpected.append(f"{path.name} {name}: {type(exc).__name__}: {exc}")
        if "steps" not in failed and "events" in failed:
            counts["partial"] += 1
        for args in [_cli_command(path, tmp_path / "export", k)]:
            res = CliRunner().invoke(cli, args)
            counts["cli"] += 1
            if res.exception is not None and not isinstance(res.exception, SystemExit):
                unexpected.append(f"{path.name} cli {args[0]}: {type(res.exception).__name__}: {res.exception}")
            elif res.exit_code not in (0, 1, 2) or "Traceback" in res.output:
                unexpected.append(f"{path.name} cli {args[0]}: exit {res.exit_code}: {res.output[-300:]}")
            elif res.exit_code == 2 and not _one_line_about(res.stderr, path):
                unexpected.append(f"{path.name} cli {args[0]}: exit 2 without one line: {res.stderr!r}")
        if k % SUBPROCESS_EVERY == 0:
            for args in (["summary", str(path)], ["doctor", str(path)]):
                proc = subprocess.run([sys.executable, "-m", "ampwatch", *args], capture_output=True, text=True,
                                      timeout=120)
                counts["subprocess"] += 1
                if proc.returncode not in (0, 1, 2) or "Traceback" in proc.stderr \
                        or (proc.returncode == 2 and not _one_line_about(proc.stderr, path)):
                    unexpected.append(f"{path.name} python -m ampwatch {args[0]}: {proc.returncode} {proc.stderr[-300:]}")
        if hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            unexpected.append(f"{path.name}: the input file changed")
    res = CliRunner().invoke(cli, ["ls", str(folder)])  # one folder of every damaged copy
    if res.exit_code != 0 or res.exception is not None and not isinstance(res.exception, SystemExit):
        unexpected.append(f"ls: exit {res.exit_code} {res.exception!r}")
    table, unreadable = rundata.runs_table(folder)
    assert len(table) + len(unreadable) == COPIES
    extra = sorted(f.name for f in folder.iterdir() if not f.name.endswith(".sqlite"))
    assert not extra, f"readers left files beside the inputs: {extra[:5]}"
    print(f"fuzz: {counts}")
    assert not unexpected, f"{len(unexpected)} failure(s), first: " + "\n".join(unexpected[:10])
    # the damage is real: most copies break some reader, many stay readable, and some are partly readable
    assert counts["RunError"] > COPIES and counts["read"] > COPIES and counts["partial"] >= 3, counts
