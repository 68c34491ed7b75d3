"""AMP series in MLflow, live (mirror="mlflow") and exported, read back with MlflowClient from a
local file store, against the run file read with plain sqlite3."""
from __future__ import annotations

import math
import subprocess
import sys
import time
import warnings

import pytest
import torch

import ampwatch
from helpers.loops import amp_step, data, mlp
from helpers.sqltruth import sql_frame

pytest.importorskip("mlflow")

STEPS = 30


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A local MLflow file store (MLflow 3 asks for an explicit opt-in to the file backend)."""
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    import mlflow
    mlflow.set_tracking_uri(uri)
    yield uri
    while mlflow.active_run() is not None:
        mlflow.end_run()


def _train(path, **options):
    model = mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 30, growth_interval=4)
    watch = ampwatch.attach(model, opt, scaler, path=str(path), layer_every=5, **options)
    for i in range(STEPS):
        amp_step(model, opt, scaler, *data(i))
    watch.close()
    return model


def _history(client, run_id, key):
    got = {m.step: m.value for m in client.get_metric_history(run_id, key)}
    assert len(got) == len(client.get_metric_history(run_id, key)), f"{key}: a step logged twice"
    return got


def _check(client, run_id, run_file):
    truth = sql_frame(run_file, "SELECT step, loss_scale, skipped, grad_norm, nan_mask FROM steps ORDER BY step")
    assert len(truth) == STEPS and truth["skipped"].sum() >= 3
    skipped, scale, norm = (_history(client, run_id, f"amp/{k}") for k in ("skipped", "loss_scale", "grad_norm"))
    assert sorted(skipped) == list(range(STEPS))
    for row in truth.itertuples():
        assert skipped[row.step] == row.skipped and scale[row.step] == row.loss_scale
        want = math.nan if row.nan_mask & 2 else row.grad_norm
        assert (math.isnan(norm[row.step]) and math.isnan(want)) or math.isclose(norm[row.step], want, rel_tol=1e-9)
    layers = sql_frame(run_file, "SELECT l.step, l.grad_norm FROM layers l JOIN tensors t ON t.id = l.param_id"
                                 " WHERE t.name = '2.weight' AND l.grad_norm IS NOT NULL")
    got = _history(client, run_id, "amp/layer_grad_norm/2.weight")
    assert {s: got[s] for s in layers["step"]} == pytest.approx(dict(zip(layers["step"], layers["grad_norm"])))


def test_live_mirror_into_the_active_run(tmp_path, store):
    import mlflow
    from mlflow.tracking import MlflowClient
    with mlflow.start_run() as active:
        _train(tmp_path / "live.sqlite", mirror="mlflow")
        assert mlflow.active_run().info.run_id == active.info.run_id  # the user's run is left running
    _check(MlflowClient(), active.info.run_id, tmp_path / "live.sqlite")


def test_export_to_mlflow_takes_the_tracking_uri_from_the_environment(tmp_path, store):
    from mlflow.tracking import MlflowClient
    _train(tmp_path / "exp.sqlite")
    proc = subprocess.run([sys.executable, "-m", "ampwatch", "export", str(tmp_path / "exp.sqlite"), "--to", "mlflow"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    runs = MlflowClient().search_runs(["0"])
    assert len(runs) == 1 and runs[0].info.run_name == "exp" and runs[0].info.status == "FINISHED"
    _check(MlflowClient(), runs[0].info.run_id, tmp_path / "exp.sqlite")


def test_a_run_deleted_mid_training_warns_once_and_recording_goes_on(tmp_path, store):
    """The tracker refuses writes mid-run (the run was deleted from the store): one warning, the
    run file complete, training unchanged."""
    import mlflow
    from mlflow.tracking import MlflowClient

    def train(mirror):
        model = mlp(0)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 30)
        options = {"mirror": "mlflow"} if mirror else {}
        watch = ampwatch.attach(model, opt, scaler, path=str(tmp_path / f"{mirror}.sqlite"), flush_every_s=0.05,
                                **options)
        for i in range(STEPS):
            if i == 10 and mirror:
                time.sleep(0.5)  # the writer thread commits and mirrors the first steps
                assert len(MlflowClient().get_metric_history(active.info.run_id, "amp/skipped")) >= 10
                MlflowClient().delete_run(active.info.run_id)
            amp_step(model, opt, scaler, *data(i))
        watch.close()
        return model

    with warnings.catch_warnings(record=True) as caught, mlflow.start_run() as active:
        warnings.simplefilter("always")
        plain, mirrored = train(False), train(True)
        MlflowClient().restore_run(active.info.run_id)  # so that the with block can end it
    mirror = [w for w in caught if "stopped mirroring" in str(w.message)]
    assert len(mirror) == 1 and "MLflow run" in str(mirror[0].message), [str(w.message) for w in caught]
    assert not [w for w in caught if "stopped recording" in str(w.message)]
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), mirrored.parameters()))
    truth = sql_frame(tmp_path / "True.sqlite", "SELECT COUNT(*) AS n, MAX(status) AS s FROM steps, run")
    assert truth["n"].iloc[0] == STEPS and truth["s"].iloc[0] == "finished"


def test_mirror_mlflow_without_an_active_run_warns_and_records(tmp_path, store):
    with pytest.warns(RuntimeWarning, match="needs an active MLflow run"):
        _train(tmp_path / "r.sqlite", mirror="mlflow")
    assert sql_frame(tmp_path / "r.sqlite", "SELECT COUNT(*) AS n FROM steps")["n"].iloc[0] == STEPS
