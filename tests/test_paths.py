"""Where a run goes. An explicit path is never silently redirected; per-rank
paths are used as given, ``{rank}`` is filled in, a path shared by ranks gets distinct files."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ampwatch
from ampwatch.errors import RunExistsError, RunPathIsFolderError
from ampwatch.record.runinfo import names_rank, resolve_path
from helpers.loops import train
from helpers.ports import free_port


def _attach(path, **options):
    return lambda m, o, s: ampwatch.attach(m, o, s, path=str(path), **options)


def test_an_existing_explicit_path_is_refused_with_one_line(tmp_path):
    target = tmp_path / "same.sqlite"
    _, first, _ = train(2, scaler_factory=lambda: torch.amp.GradScaler("cpu"), attach=_attach(target))
    before = target.read_bytes()
    with pytest.raises(RunExistsError, match=r"same\.sqlite' already exists: pass overwrite=True") as err:
        train(3, scaler_factory=lambda: torch.amp.GradScaler("cpu"), attach=_attach(target))
    assert "\n" not in str(err.value) and isinstance(err.value, ampwatch.RunError)
    assert "a run resumed from a checkpoint goes to a new path, with first_step=" in str(err.value)
    assert target.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["same.sqlite"]
    assert len(ampwatch.load(target).steps) == 2


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_folder_path_is_refused_as_a_folder_with_or_without_overwrite(tmp_path, overwrite):
    folder = tmp_path / "runs"
    folder.mkdir()
    (folder / "keep.txt").write_text("not ampwatch's")
    model = torch.nn.Linear(2, 2)
    opt, scaler = torch.optim.SGD(model.parameters(), lr=0.1), torch.amp.GradScaler("cpu")
    with pytest.raises(RunPathIsFolderError) as err:
        ampwatch.attach(model, opt, scaler, path=str(folder), overwrite=overwrite)
    message = str(err.value)
    assert isinstance(err.value, ampwatch.RunError) and "\n" not in message
    assert f"{str(folder)!r} is a folder, not a run file" in message
    assert f"path={str(folder / 'run.sqlite')!r}" in message  # what to pass instead
    assert (folder / "keep.txt").read_text() == "not ampwatch's" and sorted(p.name for p in folder.iterdir()) == ["keep.txt"]
    assert not {"scale", "step", "update", "unscale_"} & set(scaler.__dict__)  # nothing left hooked
    assert not model._forward_hooks and not model._backward_hooks


def test_overwrite_replaces_the_old_run(tmp_path):
    target = tmp_path / "same.sqlite"
    train(2, scaler_factory=lambda: torch.amp.GradScaler("cpu"), attach=_attach(target))
    _, watch, _ = train(3, scaler_factory=lambda: torch.amp.GradScaler("cpu"), attach=_attach(target, overwrite=True))
    assert watch.path == target and len(ampwatch.load(target).steps) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["same.sqlite"]


def test_the_default_path_still_numbers_and_watch_path_says_where(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    paths = [train(1, attach=lambda m, o, s: ampwatch.attach(m, o, s, name="exp"))[1].path for _ in range(2)]
    assert paths == [tmp_path / "runs" / "exp.sqlite", tmp_path / "runs" / "exp-2.sqlite"]


@pytest.mark.parametrize("path, rank, expected", [
    ("runs/x.sqlite", 0, "runs/x.rank0.sqlite"),     # shared by every rank: distinct per rank
    ("runs/x.sqlite", 1, "runs/x.rank1.sqlite"),
    ("runs/x_1.sqlite", 1, "runs/x_1.sqlite"),       # an f-string with the rank filled in: as given
    ("runs/rank3/x.sqlite", 3, "runs/rank3/x.sqlite"),
    ("runs/x.rank2.sqlite", 2, "runs/x.rank2.sqlite"),
    ("runs/x-{rank}.sqlite", 1, "runs/x-1.sqlite"),   # the placeholder
    ("runs/exp1.sqlite", 1, "runs/exp1.rank1.sqlite"),  # a digit inside a word names no rank
    ("runs/x_12.sqlite", 2, "runs/x_12.rank2.sqlite"),
])
def test_rank_aware_paths_single_process(tmp_path, path, rank, expected):
    got, note = resolve_path(str(tmp_path / path), None, rank, 4)
    assert got == tmp_path / expected
    assert (note is not None) == (got.name != Path(path.replace("{rank}", str(rank))).name)
    assert resolve_path(str(tmp_path / path), None, rank, 1)[0] == tmp_path / path.replace("{rank}", str(rank))


def test_a_fixed_path_that_contains_a_rank_number_still_gives_distinct_files(tmp_path):
    path = str(tmp_path / "lr_1e-4.sqlite")  # rank 1 reads "_1" as its rank: it keeps the name
    files = {resolve_path(path, None, r, 2)[0] for r in range(2)}
    assert len(files) == 2 and names_rank(path, 1) and not names_rank(path, 0)


def test_two_gloo_ranks_get_their_own_files_for_every_kind_of_path(tmp_path):
    worker = Path(__file__).parent / "helpers" / "paths_worker.py"
    proc = subprocess.run([sys.executable, str(worker), str(tmp_path), free_port()],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    files = sorted(p.name for p in tmp_path.glob("*.sqlite"))
    assert files == ["ph-0.sqlite", "ph-1.sqlite", "run_0.sqlite", "run_1.sqlite",
                     "shared.rank0.sqlite", "shared.rank1.sqlite"]
    for name in files:
        run = ampwatch.load(tmp_path / name)
        assert len(run.steps) == 2 and run.info["world_size"] == 2
        assert f"rank{run.info['rank']}" in name or f"-{run.info['rank']}" in name or f"_{run.info['rank']}" in name
    # the shared path is explained once per rank; the per-rank paths are not
    assert proc.stderr.count("names no rank") == 2 and "shared.sqlite' names no rank" in proc.stderr
