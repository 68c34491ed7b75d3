"""The Runs page draws its table before the doctor has read long runs: their health fills in from a
background thread (app/diagnoses.py), and a page that opens one of them reuses that work.

The real app in AppTest, the real doctor on copies of the sample runs; the background thread is held
busy by a job of the test's own, so what the page shows while it waits is not a race."""
from __future__ import annotations

import importlib
import shutil
import threading
from pathlib import Path

import pytest

import ampwatch
from ampwatch.doctor import health
from helpers.app_pages import open_page
from helpers.sqltruth import sql_frame

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_runs"

pytestmark = pytest.mark.usefixtures("restore_runs_env")


@pytest.fixture
def app_modules(monkeypatch):
    """The app's own modules, as Streamlit (and AppTest) import them: top-level names."""
    monkeypatch.syspath_prepend(str(ROOT / "app"))
    return importlib.import_module("loaders"), importlib.import_module("diagnoses")


def _occupy(diagnoses, tmp_path: Path) -> threading.Event:
    """Hold the doctor's one background thread until the returned event is set."""
    started, release = threading.Event(), threading.Event()

    def hold(_path: str) -> list:
        started.set()
        release.wait(120)
        return []
    diagnoses.start(str(tmp_path / "holder"), (id(release),), hold)  # a job of its own each time
    assert started.wait(30)
    return release


def _wait(diagnoses, path: Path, key: tuple) -> None:
    for _ in range(600):
        if diagnoses.finished(str(path), key) is not None:
            return
        threading.Event().wait(0.1)
    raise AssertionError(f"{path.name} was not diagnosed")


def test_the_table_comes_first_and_the_health_fills_in(tmp_path, monkeypatch, app_modules):
    loaders, diagnoses = app_modules
    monkeypatch.setattr(loaders, "INLINE_DOCTOR_STEPS", 0)  # every run counts as long
    calls: list[str] = []
    real = loaders._diagnose
    monkeypatch.setattr(loaders, "_diagnose", lambda path: calls.append(Path(path).name) or real(path))
    folder = tmp_path / "runs"
    folder.mkdir()
    names = ["diverged.sqlite", "healthy_fp16.sqlite"]
    for name in names:
        shutil.copy(SAMPLES / name, folder / name)
    truth = {name: health(ampwatch.diagnose(str(folder / name))) for name in names}
    assert truth["diverged.sqlite"].startswith("error:") and truth["healthy_fp16.sqlite"] == "ok"

    release = _occupy(diagnoses, tmp_path)
    try:
        at = open_page(folder)
        assert not at.exception, [e.value for e in at.exception]
        shown = at.dataframe(key="runs_table").value.set_index("file")
        assert list(shown["health"]) == ["diagnosing...", "diagnosing..."]
        assert list(shown["steps"]) == [int(sql_frame(folder / n, "SELECT COUNT(*) n FROM steps")["n"].iloc[0])
                                    for n in names]
        waiting = [c.value for c in at.caption if c.value.startswith("The doctor is reading")]
        assert waiting and "2 runs" in waiting[0] and all(n in waiting[0] for n in names)
    finally:
        release.set()
    for name in names:
        _wait(diagnoses, folder / name, loaders.stamp(folder / name))
    at.run()
    shown = at.dataframe(key="runs_table").value.set_index("file")
    assert {n: shown.loc[n, "health"] for n in names} == truth
    assert not [c for c in at.caption if c.value.startswith("The doctor is reading")]
    assert sorted(calls) == names  # each run read once

    # the overview of a run the Runs page diagnosed shows its findings without running the doctor again
    at.session_state["run"] = "diverged.sqlite"
    at.switch_page("app_pages/overview.py")
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    first_root = next(f for f in ampwatch.diagnose(str(folder / "diverged.sqlite")) if f.cause is None)
    assert first_root.title in " ".join(m.value for m in at.markdown)
    assert sorted(calls) == names


def test_a_page_does_not_wait_behind_the_queue(tmp_path, monkeypatch, app_modules):
    """A run queued behind others is taken out of the queue and read on the page's own thread."""
    loaders, diagnoses = app_modules
    monkeypatch.setattr(loaders, "INLINE_DOCTOR_STEPS", 0)
    folder = tmp_path / "runs"
    folder.mkdir()
    shutil.copy(SAMPLES / "overflow_storm.sqlite", folder / "storm.sqlite")
    release = _occupy(diagnoses, tmp_path)
    try:
        at = open_page(folder)
        assert at.dataframe(key="runs_table").value["health"].tolist() == ["diagnosing..."]
        key = loaders.stamp(folder / "storm.sqlite")
        assert diagnoses.finished(str(folder / "storm.sqlite"), key) is None  # queued
        got: list = []  # asked while the background thread is still held: must not wait for it
        asker = threading.Thread(target=lambda: got.append(loaders.findings(str(folder / "storm.sqlite"), key)))
        asker.start()
        asker.join(30)
        assert got, "the page waited behind the queue"
        found = got[0]
        want = [f.to_dict() for f in ampwatch.diagnose(str(folder / "storm.sqlite"))]
        assert [(f["id"], f["title"]) for f in found] == [(f["id"], f["title"]) for f in want]
        at.run()  # now known: no longer waiting
        assert at.dataframe(key="runs_table").value["health"].tolist() == [loaders.health(want)]
    finally:
        release.set()


def test_a_newer_version_of_a_file_supersedes_the_queued_one(tmp_path, app_modules):
    """A live run changes while its job waits: the old job is dropped, the new one runs, and the
    file's latest verdict stays readable while the next one is worked out."""
    _, diagnoses = app_modules
    path = str(tmp_path / "live.sqlite")
    release = _occupy(diagnoses, tmp_path)
    try:
        old = diagnoses.start(path, (1,), lambda p: ["v1"])
        new = diagnoses.start(path, (2,), lambda p: ["v2"])
        assert old.cancelled() and not new.done()
        assert diagnoses.finished(path, (1,)) is None and diagnoses.latest(path) is None
    finally:
        release.set()
    assert new.result(30) == ["v2"] and diagnoses.latest(path) is new
    assert diagnoses.finished(path, (2,)) is new
    release = _occupy(diagnoses, tmp_path)
    try:
        diagnoses.start(path, (3,), lambda p: ["v3"])
        assert diagnoses.finished(path, (3,)) is None and diagnoses.latest(path).result() == ["v2"]
    finally:
        release.set()


def test_a_run_the_doctor_cannot_read_says_so_in_its_health(tmp_path, monkeypatch, app_modules):
    """A failure is kept for that version of the file (not retried on every redraw) and shown as one line."""
    loaders, diagnoses = app_modules
    path = tmp_path / "runs" / "broken.sqlite"
    path.parent.mkdir()
    shutil.copy(SAMPLES / "healthy_fp16.sqlite", path)
    calls = []

    def failing(p: str) -> list:
        calls.append(p)
        raise ampwatch.RunError(f"{p}: cannot be read")
    monkeypatch.setattr(loaders, "_diagnose", failing)
    first = loaders.runs_health(path.parent, ["broken.sqlite"])
    again = loaders.runs_health(path.parent, ["broken.sqlite"])
    assert first == again == [f"unreadable: {path}: cannot be read"] and len(calls) == 1


def test_a_run_past_the_overviews_limit_is_read_only_on_request(tmp_path, monkeypatch, app_modules):
    """As its overview asks before running the doctor past AUTO_DOCTOR_STEPS, the Runs page does not
    spend that time by itself; once the overview has run it on request, the table shows the verdict."""
    loaders, diagnoses = app_modules
    monkeypatch.setattr(loaders, "AUTO_DOCTOR_STEPS", 100)  # diverged.sqlite: 250 steps
    folder = tmp_path / "runs"
    folder.mkdir()
    shutil.copy(SAMPLES / "diverged.sqlite", folder / "diverged.sqlite")
    at = open_page(folder)
    assert not at.exception, [e.value for e in at.exception]
    shown = at.dataframe(key="runs_table").value
    assert shown["health"].tolist() == ["not diagnosed: 250 steps (its overview runs the doctor on request)"]
    assert not [c for c in at.caption if c.value.startswith("The doctor is reading")]  # nothing to wait for
    threading.Event().wait(1.0)
    assert diagnoses.finished(str(folder / "diverged.sqlite"), loaders.stamp(folder / "diverged.sqlite")) is None

    at.session_state["run"] = "diverged.sqlite"
    at.switch_page("app_pages/overview.py")
    at.run()
    at.button(key="run_doctor").click().run()
    want = health(ampwatch.diagnose(str(folder / "diverged.sqlite")))
    assert want.startswith("error:") and want.split(": ", 1)[1] in " ".join(m.value for m in at.markdown)
    at.switch_page("app_pages/runs.py")
    at.run()
    assert at.dataframe(key="runs_table").value["health"].tolist() == [want]


def test_many_short_runs_are_read_before_the_table_only_for_a_while(tmp_path, monkeypatch, app_modules):
    """A folder of many short runs: each costs the doctor's fixed time, so past INLINE_DOCTOR_S the
    rest go to the background however few steps they hold."""
    loaders, diagnoses = app_modules
    folder = tmp_path / "runs"
    folder.mkdir()
    names = [f"r{i}.sqlite" for i in range(3)]
    for name in names:
        shutil.copy(SAMPLES / "healthy_fp16.sqlite", folder / name)
    monkeypatch.setattr(loaders, "INLINE_DOCTOR_S", 0.0)
    release = _occupy(diagnoses, tmp_path)
    try:
        assert loaders.runs_health(folder, names) == [None, None, None]  # queued, not read now
    finally:
        release.set()
    monkeypatch.setattr(loaders, "INLINE_DOCTOR_S", 600.0)
    (folder / "r3.sqlite").write_bytes((SAMPLES / "healthy_fp16.sqlite").read_bytes())
    release = _occupy(diagnoses, tmp_path)
    try:
        assert loaders.runs_health(folder, ["r3.sqlite"]) == ["ok"]  # within both budgets: read now
    finally:
        release.set()
