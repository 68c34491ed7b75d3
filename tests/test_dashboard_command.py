"""`ampwatch dashboard`: bad input is one line and exit 2 before anything starts; from a clone it
finds app/, and it asks Streamlit for loopback only and no usage statistics.

The server really started, from a wheel in a fresh virtualenv, is in test_install.py.
"""
from __future__ import annotations

import socket
import sys
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from ampwatch.cli.main import cli
from ampwatch.dashboard import launch

ROOT = Path(__file__).resolve().parent.parent


def _listening() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def _one_line_exit_2(args: list[str]) -> str:
    result = CliRunner().invoke(cli, ["dashboard", *args])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and result.stdout == "", result.output
    return lines[0]


def test_a_missing_folder_or_a_file(tmp_path):
    missing = tmp_path / "nope"
    assert _one_line_exit_2([str(missing)]) == (
        f"ampwatch: runs folder {str(missing)!r} does not exist: pass a folder of .sqlite runs "
        f"(ampwatch demo --out {missing} writes sample runs there)")
    run = tmp_path / "a.sqlite"
    run.write_bytes(b"")
    assert _one_line_exit_2([str(run)]) == (
        f"ampwatch: {str(run)!r} is a file, not a folder: pass the folder that holds the runs "
        f"(ampwatch dashboard {str(tmp_path)!r})")


@pytest.mark.parametrize("port", ["abc", "80.5", "0", "70000", "-1", ""])
def test_a_port_that_is_not_a_number(tmp_path, port):
    assert _one_line_exit_2([str(tmp_path), "--port", port]) == (
        f"ampwatch: --port {port!r} is not a port number: pass a whole number from 1 to 65535")


def test_a_port_in_use(tmp_path):
    with _listening() as busy:
        port = busy.getsockname()[1]
        assert _one_line_exit_2([str(tmp_path), "--port", str(port)]) == (
            f"ampwatch: port {port} on 127.0.0.1 is in use: pass another --port, or stop what listens there")


def test_a_host_that_is_not_an_address_here(tmp_path):
    line = _one_line_exit_2([str(tmp_path), "--host", "no-such-host.invalid"])
    assert line.startswith("ampwatch: cannot listen on --host 'no-such-host.invalid' (")
    assert line.endswith("): pass an address of this machine, e.g. 127.0.0.1 (the default)")


def test_the_default_port_moves_past_a_busy_one(monkeypatch):
    with _listening() as busy:
        monkeypatch.setattr(launch, "FIRST_PORT", busy.getsockname()[1])
        chosen = launch.free_port("127.0.0.1", None)
        assert chosen > busy.getsockname()[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", chosen))  # it was really free


def test_from_a_clone_the_app_is_the_repositorys(tmp_path, monkeypatch):
    assert launch.app_script() == ROOT / "app" / "streamlit_app.py"
    monkeypatch.chdir(tmp_path)  # whatever the current folder
    monkeypatch.delenv("AMPWATCH_RUNS", raising=False)
    (tmp_path / "runs").mkdir()
    argv, env = launch.command("runs", "8599", "127.0.0.1")
    assert argv[:5] == [sys.executable, "-m", "streamlit", "run", str(ROOT / "app" / "streamlit_app.py")]
    flags = dict(zip(argv[5::2], argv[6::2]))
    assert flags == {"--server.address": "127.0.0.1", "--server.port": "8599", "--server.headless": "true",
                     "--browser.gatherUsageStats": "false", "--client.toolbarMode": "minimal",
                     "--browser.serverAddress": "127.0.0.1"}
    assert env["AMPWATCH_RUNS"] == str(tmp_path / "runs")  # absolute: the app may not share our folder


def test_extras_training_box_and_dashboard():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {dep.split(">")[0].split("=")[0].split("[")[0] for dep in project["dependencies"]}
    assert names == {"torch", "sqlite-utils", "click", "pandas", "numpy"}
    extras = project["optional-dependencies"]
    assert set(extras["dashboard"]) == {"streamlit>=1.40", "plotly>=5.20"}
    assert set(extras["dashboard"]) <= set(extras["dev"])  # make install / make test get the dashboard too
    assert "-e '.[dev]'" in (ROOT / "Makefile").read_text()
