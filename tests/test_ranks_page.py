"""The dashboard's Ranks page (AppTest) and its figure, on a synthetic job and a single run."""
from __future__ import annotations

import base64
import os
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.io
import pytest
from streamlit.testing.v1 import AppTest

from ampwatch.dashboard import figures
from ampwatch.dashboard.ranks import job_view
from helpers.synthetic_job import bad_batch_job


def _values(v) -> list:
    """Trace data as a list: Plotly's JSON carries numpy arrays as {'dtype', 'bdata'} (base64)."""
    if isinstance(v, dict) and "bdata" in v:
        return np.frombuffer(base64.b64decode(v["bdata"]), dtype=np.dtype(v["dtype"])).tolist()
    return list(v)


ROOT = Path(__file__).resolve().parent.parent
APP = str(ROOT / "app" / "streamlit_app.py")


pytestmark = pytest.mark.usefixtures("restore_runs_env")


def _ranks_page(folder: Path, run: str, state: dict | None = None) -> AppTest:
    os.environ["AMPWATCH_RUNS"] = str(folder)
    at = AppTest.from_file(APP, default_timeout=60)
    at.query_params["run"] = run
    at.run()
    for k, v in (state or {}).items():
        at.session_state[k] = v
    at.switch_page("app_pages/ranks.py")
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_ranks_page_marks_the_first_rank_and_picks_a_rank(tmp_path):
    bad_batch_job(tmp_path, world=3, bad_rank=1, bad_step=25)
    at = _ranks_page(tmp_path, "job.rank0.sqlite")
    assert at.title[0].value == "Ranks of job"
    text = " ".join(m.value for m in at.markdown)
    assert "A bad batch on rank 1" in text and "rank 1 at step 25, 0 (forward), micro-batch 1" in text
    fig = plotly.io.from_json(at.get("plotly_chart")[0].proto.spec)
    names = [t.name for t in fig.data]
    assert [n for n in names if n.startswith("rank ")] == ["rank 0", "rank 0", "rank 1", "rank 1", "rank 2", "rank 2"]
    star = next(t for t in fig.data if t.name == "first NaN/Inf: rank 1")
    assert _values(star.x) == [25] and star.meta == 1
    skip = next(t for t in fig.data if t.name.startswith("skipped on every rank"))
    assert _values(skip.x) == [25]
    assert at.selectbox(key="ranks_pick").value == 1  # the first rank to go non-finite, picked
    table = next(d.value for d in at.dataframe if "first_nonfinite_step" in d.value.columns)
    assert table["rank"].tolist() == [0, 1, 2] and table["skipped"].tolist() == [1, 1, 1]
    at.selectbox(key="ranks_pick").set_value(2).run()
    fig = plotly.io.from_json(at.get("plotly_chart")[0].proto.spec)
    widths = {t.name: t.line.width for t in fig.data if t.name.startswith("rank ")}
    assert widths["rank 2"] == 2.5 and widths["rank 0"] == 1
    at.button(key="ranks_open").click().run()
    assert at.session_state["run"] == "job.rank2.sqlite"


def test_ranks_page_with_a_missing_rank_and_a_single_run(tmp_path):
    bad_batch_job(tmp_path, world=3)
    (tmp_path / "job.rank2.sqlite").unlink()
    at = _ranks_page(tmp_path, "job.rank1.sqlite")
    assert any("rank 2: no file" in w.value for w in at.warning)
    at = _ranks_page(ROOT / "sample_runs", "healthy_fp16.sqlite")
    assert any("single-process run" in i.value for i in at.info)


def test_ranks_figure_carries_the_rank_of_every_trace(tmp_path):
    view = job_view(bad_batch_job(tmp_path, world=2, bad_rank=0, bad_step=5), "job.rank1.sqlite")
    fig = figures.ranks_figure(view.steps, view.global_steps, view.first, selected=None)
    per_rank = [t for t in fig.data if (t.name or "").startswith("rank ")]
    assert [t.meta for t in per_rank] == [0, 0, 1, 1]
    assert all(set(np.asarray(t.customdata).tolist()) == {t.meta} for t in per_rank)
    glob = next(t for t in fig.data if t.name == "global grad norm")
    assert np.allclose(np.asarray(glob.y, dtype=float), 0.5)


def test_a_warmup_overflow_first_is_said_to_be_expected(tmp_path):
    """A DDP job whose first NaN/Inf is the scaler's warm-up (init_scale too high, every rank skips
    step 0): the page said 'First NaN/Inf: rank 0 at step 0' like a fault, with no word of the others."""
    import sqlite3
    from helpers.synthetic_job import write_rank
    for r in range(2):
        rows = [(i, 0.0, 0.1, 1.0 - 0.01 * i, 2.0 ** max(22, 24 - i), int(i < 2), None if i < 2 else 0.5,
                 1e-3, 1, 0) for i in range(12)]
        path = write_rank(tmp_path, f"ddp.rank{r}", r, 2, rows, sharding="replicated",
                          events=((0, "param_grad", "0.weight", "inf", 8, None, "float32", 0, 0),))
        conn = sqlite3.connect(path)
        with conn:
            conn.execute("UPDATE run SET scaler_enabled = 1, init_scale = 16777216.0")
        conn.close()
    view = job_view(tmp_path, "ddp.rank1.sqlite")
    assert view.first["step"] == 0 and view.first["warmup"] and view.first["ranks"] == [0, 1]
    at = _ranks_page(tmp_path, "ddp.rank1.sqlite")
    text = " ".join(m.value for m in at.markdown)
    assert "rank 0 at step 0, 0.weight (param_grad), micro-batch 0 (also rank 1 at that step): a gradient " \
           "overflow during the scaler's warm-up, expected" in text
    (tmp_path / "bad").mkdir()
    bad = job_view(bad_batch_job(tmp_path / "bad", world=3, bad_rank=1, bad_step=25), "job.rank0.sqlite")
    assert bad.first["step"] == 25 and not bad.first["warmup"]  # a forward overflow is never the warm-up's


def test_ranks_table_sorts_steps_as_numbers_and_tells_a_nan_loss_from_none(tmp_path):
    """The Ranks table showed 'None' for a rank that never went non-finite and for a NaN last loss
    alike. Now the first NaN/inf step is a number column (it sorts 7 before 25; '–' where there is
    none) and a NaN last loss reads 'NaN'. Ground truth: the rows written to each rank's file."""
    import json
    from helpers.synthetic_job import step_rows, write_rank
    clean = step_rows(np.full(30, 0.5), np.full(30, 2.0), set())
    write_rank(tmp_path, "job.rank0", 0, 3, clean, sharding="replicated")
    late = step_rows(np.full(30, 0.5), np.full(30, 2.0), {25})
    write_rank(tmp_path, "job.rank1", 1, 3, late, sharding="replicated",
               events=((25, "forward", "0", "nan", 4, None, "float16", 1, 0),))
    early = step_rows(np.full(30, 0.5), np.full(30, 2.0), {7})
    early[-1] = early[-1][:3] + (None,) + early[-1][4:9] + (1,)  # the last loss NaN (stored as its bit)
    write_rank(tmp_path, "job.rank2", 2, 3, early, sharding="replicated",
               events=((7, "forward", "0", "inf", 2, None, "float16", 1, 0),))
    at = _ranks_page(tmp_path, "job.rank0.sqlite")
    table = next(d for d in at.dataframe if "first_nonfinite_step" in d.value.columns)
    shown = table.value.set_index("rank")
    assert str(shown["first_nonfinite_step"].dtype) == "Int64"
    assert json.loads(table.proto.columns)["first_nonfinite_step"]["type_config"]["type"] == "number"
    assert table.proto.placeholder == "–"
    assert shown.loc[0, "first_nonfinite_step"] is pd.NA
    assert shown.loc[1, "first_nonfinite_step"] == 25 and shown.loc[2, "first_nonfinite_step"] == 7
    assert shown.loc[2, "last_loss"] == "NaN" and shown.loc[0, "last_loss"] == "2"
