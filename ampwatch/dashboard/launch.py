"""Starting the Streamlit dashboard that ships inside the package (``ampwatch dashboard``).

The app's files are the repository's ``app/`` folder; the wheel ships them as
``ampwatch/dashboard/app/`` (setup.py maps the one onto the other), so an installed ampwatch finds
them beside itself, and a clone or an editable install finds ``app/`` beside the package. The
Streamlit settings that a clone keeps in ``.streamlit/config.toml`` (listen on loopback only, no
usage statistics) are passed on the command line instead: Streamlit reads that file from the
current folder only, and command-line flags win over any config file found there.

Nothing here imports Streamlit (it is an optional extra) or torch: a missing dependency, runs
folder or free port is one :class:`DashboardError` line, raised before Streamlit starts.
"""
from __future__ import annotations

import errno
import importlib.util
import os
import socket
import sys
from pathlib import Path
from typing import Optional

from ..errors import DashboardError

NEEDS = ("streamlit", "plotly")  # the [dashboard] extra
INSTALL = "pip install 'ampwatch[dashboard]'"
FIRST_PORT = 8501  # Streamlit's own default; the next free one is taken when it is busy
PORTS_TRIED = 100


def app_script() -> Path:
    """The dashboard's ``streamlit_app.py``: inside the installed package, else (a clone or an
    editable install, where the package is the repository's ``ampwatch/``) ``app/`` beside it."""
    package = Path(__file__).resolve().parent.parent
    shipped = package / "dashboard" / "app" / "streamlit_app.py"
    if shipped.is_file():
        return shipped
    source = package.parent / "app" / "streamlit_app.py"
    if source.is_file() and (package.parent / "pyproject.toml").is_file():
        return source
    raise DashboardError(f"the dashboard's files are missing from this ampwatch ({str(package)!r} has no "
                         f"dashboard/app/streamlit_app.py): reinstall it, e.g. {INSTALL}")


def check_dependencies() -> None:
    missing = [name for name in NEEDS if importlib.util.find_spec(name) is None]
    if missing:
        raise DashboardError(f"the dashboard needs {' and '.join(missing)}, which this Python lacks: {INSTALL}")


def runs_folder(folder: str) -> Path:
    """``folder`` as an absolute path, if it is an existing folder."""
    path = Path(folder).expanduser()
    if not folder or not path.exists():
        raise DashboardError(f"runs folder {folder!r} does not exist: pass a folder of .sqlite runs "
                             f"(ampwatch demo --out {folder or 'sample_runs'} writes sample runs there)")
    if not path.is_dir():
        raise DashboardError(f"{folder!r} is a file, not a folder: pass the folder that holds the runs "
                             f"(ampwatch dashboard {str(path.parent)!r})")
    return path.resolve()


def port_number(port: Optional[str]) -> Optional[int]:
    """``--port`` as a number from 1 to 65535; None when not given."""
    if port is None:
        return None
    text = port.strip()
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise DashboardError(f"--port {port!r} is not a port number: pass a whole number from 1 to 65535")
    return int(text)


def _bindable(host: str, port: int) -> Optional[OSError]:
    """None when a server could listen on (host, port) now, else why not."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        return OSError(errno.EADDRNOTAVAIL, getattr(exc, "strerror", None) or str(exc))
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        # what Tornado (Streamlit's server) sets: a port that only lingers in TIME_WAIT is free
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as exc:
            return exc
    return None


def free_port(host: str, port: Optional[int]) -> int:
    """``port`` if it can be listened on at ``host``; without one, the first free port from 8501."""
    if not host:
        raise DashboardError("--host is empty: pass an address of this machine, e.g. 127.0.0.1")
    for candidate in [port] if port is not None else range(FIRST_PORT, FIRST_PORT + PORTS_TRIED):
        problem = _bindable(host, candidate)
        if problem is None:
            return candidate
        if problem.errno != errno.EADDRINUSE:
            raise DashboardError(f"cannot listen on --host {host!r} ({problem.strerror or problem}): pass an "
                                 f"address of this machine, e.g. 127.0.0.1 (the default)")
    if port is not None:
        raise DashboardError(f"port {port} on {host} is in use: pass another --port, or stop what listens there")
    raise DashboardError(f"ports {FIRST_PORT}-{FIRST_PORT + PORTS_TRIED - 1} on {host} are all in use: "
                         f"pass a free one with --port")


def command(folder: str, port: Optional[str], host: str) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that start the dashboard on ``folder``, once every input
    is checked (:class:`DashboardError` otherwise)."""
    check_dependencies()
    script = app_script()
    runs = runs_folder(folder)
    chosen = free_port(host, port_number(port))
    argv = [sys.executable, "-m", "streamlit", "run", str(script),
            "--server.address", host, "--server.port", str(chosen), "--server.headless", "true",
            "--browser.gatherUsageStats", "false", "--client.toolbarMode", "minimal"]
    if host not in ("0.0.0.0", "::"):  # the address Streamlit prints as the URL to open
        argv += ["--browser.serverAddress", host]
    return argv, dict(os.environ, AMPWATCH_RUNS=str(runs))


def start(folder: str, port: Optional[str], host: str) -> None:
    """Replace this process with Streamlit serving the dashboard (returns only on bad input, by
    raising :class:`DashboardError`). Ctrl-C and signals then reach Streamlit directly."""
    argv, env = command(folder, port, host)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], argv, env)
