"""The wheel, installed the way a new user installs it: outside the clone, in fresh virtualenvs.

- The wheel holds the dashboard (every file of app/) and asks for neither Streamlit nor Plotly
  unless the [dashboard] extra is named.
- Training side: `pip install ampwatch` (the wheel) records and reads a run, and the CLI's text
  commands work, with neither streamlit nor plotly importable; `ampwatch dashboard` then says in
  one line how to install them.
- Viewing side: `pip install 'ampwatch[dashboard]'` (the same wheel), `ampwatch dashboard` started
  in an empty temporary folder: headless Chromium sees the Runs page list a sample run, served
  from the installed package, listening on loopback only.
- An editable install finds the repository's app/.

One wheel and one virtualenv serve the whole test session. torch is not installed into the
virtualenv again: the files of the torch this interpreter runs (and of what torch requires) are
linked into a folder the virtualenv reads through a .pth file, so pip sees torch installed, as on a
box where the user installed their own torch first (`pip install torch` there could pull a
multi-GB CUDA build). Everything else comes from pip, as the wheel's metadata asks.
"""
from __future__ import annotations

import ipaddress
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from helpers.servers import wait_until_healthy

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts"
SOURCES = ("pyproject.toml", "setup.py", "README.md", "ampwatch", "app")
DASHBOARD_HINT = "pip install 'ampwatch[dashboard]'"

pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    """This environment less what would let the virtualenv see the clone or another Python's packages."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "AMPWATCH_RUNS")}
    env.update(PYTHONNOUSERSITE="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def _run(argv: list, cwd: Path, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in argv], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=timeout)
    if check:
        assert done.returncode == 0, f"{argv}: {done.stdout[-2000:]}{done.stderr[-3000:]}"
    return done


def _link_torch(into: Path) -> None:
    """Symlink the installed torch, and every distribution it requires, files and dist-info, into ``into``."""
    from packaging.requirements import Requirement
    todo, seen = ["torch"], set()
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:  # a requirement whose marker left it out here
            continue
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
        site = Path(str(dist.locate_file("")))
        tops = {Path(str(f)).parts[0] for f in dist.files or []} - {"..", "__pycache__"}
        for top in tops:
            if (site / top).exists() and not (into / top).exists():
                (into / top).symlink_to(site / top)


class Venv:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.python = path / "bin" / "python"
        self.dashboard = False  # the [dashboard] extra is installed

    def pip(self, *args: str) -> None:
        _run([self.python, "-m", "pip", "install", "-q", "--no-compile", *args], cwd=self.path, timeout=600)

    def site_packages(self) -> Path:
        return Path(_run([self.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         cwd=self.path).stdout.strip())


def _new_venv(path: Path, with_torch: bool) -> Venv:
    _run([sys.executable, "-m", "venv", path], cwd=path.parent, timeout=120)
    venv = Venv(path)
    if with_torch:
        linked = path / "torch-linked"
        linked.mkdir()
        _link_torch(linked)
        (venv.site_packages() / "torch_linked.pth").write_text(f"{linked}\n")
    return venv


@pytest.fixture(scope="session")
def sources(tmp_path_factory) -> Path:
    """The files a wheel is built from, copied out of the clone (the clone stays untouched)."""
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(ROOT / name, src / name)
    return src


@pytest.fixture(scope="session")
def wheel(sources, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", out, sources], cwd=out, timeout=600)
    (built,) = out.glob("ampwatch-*.whl")
    return built


@pytest.fixture(scope="session")
def venvs(wheel, tmp_path_factory):
    """``get(dashboard)``: a virtualenv with the wheel installed, and its [dashboard] extra when
    asked. One is shared; a training-side request after the extra went in gets a new one."""
    made: list[Venv] = []

    def get(dashboard: bool) -> Venv:
        if not made or (made[-1].dashboard and not dashboard):
            venv = _new_venv(tmp_path_factory.mktemp("venv") / "v", with_torch=True)
            venv.pip(str(wheel))
            made.append(venv)
        venv = made[-1]
        if dashboard and not venv.dashboard:
            venv.pip(f"{wheel}[dashboard]")
            venv.dashboard = True
        return venv
    return get


def test_the_wheel_holds_the_dashboard_and_asks_for_it_only_as_an_extra(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    app_files = {f"ampwatch/dashboard/app/{p.relative_to(ROOT / 'app').as_posix()}"
                 for p in (ROOT / "app").rglob("*.py") if "__pycache__" not in p.parts}
    assert "ampwatch/dashboard/app/streamlit_app.py" in app_files and len(app_files) >= 10
    assert app_files <= names
    assert "ampwatch/dashboard/launch.py" in names and "ampwatch/record/watch.py" in names
    requires = [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    for dep in ("streamlit", "plotly"):
        mentions = [r for r in requires if r.startswith(dep)]
        assert mentions and all('extra == "dashboard"' in r or 'extra == "dev"' in r for r in mentions), mentions
    assert any(r.startswith("torch") and "extra" not in r for r in requires)


_TRAIN = r"""
import json, sys
import torch
from torch import nn
import ampwatch
torch.manual_seed(0)
torch.set_num_threads(1)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.5)
# fp16 gradients overflow at this scale: the first steps are skipped while it backs off
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24, growth_interval=5)
g = torch.Generator().manual_seed(0)
applied, losses = [], []
with ampwatch.attach(model, opt, scaler, path="runs/wheel.sqlite") as watch:
    for _ in range(30):
        x, y = torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g)
        before = [p.detach().clone() for p in model.parameters()]
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        applied.append(any(not torch.equal(b, p) for b, p in zip(before, model.parameters())))
        losses.append(loss.item())
run = ampwatch.load("runs/wheel.sqlite")
print(json.dumps({"file": ampwatch.__file__, "skipped": run.steps["skipped"].tolist(), "applied": applied,
                  "loss": run.steps["loss"].tolist(), "truth_loss": losses,
                  "findings": [f.id for f in ampwatch.diagnose(run)],
                  "loaded": sorted(m for m in sys.modules if m.split(".")[0] in ("streamlit", "plotly"))}))
"""


def test_training_install_records_and_reads_without_the_dashboard(venvs, tmp_path):
    venv = venvs(dashboard=False)
    for module in ("streamlit", "plotly"):
        done = _run([venv.python, "-c", f"import {module}"], cwd=tmp_path, check=False)
        assert done.returncode == 1 and f"No module named '{module}'" in done.stderr
    report = json.loads(_run([venv.python, "-c", _TRAIN], cwd=tmp_path).stdout.strip().splitlines()[-1])
    assert report["file"].startswith(str(venv.path)), report["file"]  # the wheel's ampwatch, not the clone's
    assert report["loaded"] == []
    assert 1 <= sum(report["skipped"]) < 30
    assert report["skipped"] == [not a for a in report["applied"]]
    assert report["loss"] == pytest.approx(report["truth_loss"], rel=1e-6)

    ampwatch = venv.path / "bin" / "ampwatch"
    summary = _run([ampwatch, "summary", "runs/wheel.sqlite"], cwd=tmp_path).stdout
    assert f"steps    30  skipped {sum(report['skipped'])} " in summary
    assert "wheel" in _run([ampwatch, "ls", "runs"], cwd=tmp_path).stdout
    doctor = json.loads(_run([ampwatch, "doctor", "runs/wheel.sqlite", "--json", "--fail-on", "never"],
                             cwd=tmp_path).stdout)
    assert doctor["run"] == "wheel" and [f["id"] for f in doctor["findings"]] == report["findings"]
    _run([ampwatch, "export", "runs/wheel.sqlite", "--out", "exported"], cwd=tmp_path)
    assert len((tmp_path / "exported" / "wheel_steps.csv").read_text().splitlines()) == 31

    done = _run([ampwatch, "dashboard", "runs"], cwd=tmp_path, check=False)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        f"ampwatch: the dashboard needs streamlit and plotly, which this Python lacks: {DASHBOARD_HINT}"]


def _listening_on(port: int) -> list:
    """The local addresses of sockets listening on ``port``, from /proc/net/tcp and tcp6."""
    found = []
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            address, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)  # each 32-bit word in host (little-endian) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
                found.append(ipaddress.ip_address(raw))
    return found


def _loopback(address) -> bool:
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.browser
def test_dashboard_from_the_wheel_in_chromium(venvs, tmp_path):
    from test_browser import _no_errors, _require_browser, _wait
    _require_browser()
    with socket.socket() as control:  # the reading of /proc tells loopback from every interface
        control.bind(("0.0.0.0", 0))
        control.listen()
        assert [str(a) for a in _listening_on(control.getsockname()[1])] == ["0.0.0.0"]

    venv = venvs(dashboard=True)
    (tmp_path / "runs").mkdir()  # an empty folder but for the runs: no .streamlit/config.toml here
    shutil.copy2(ROOT / "sample_runs" / "healthy_fp16.sqlite", tmp_path / "runs")
    port = _free_port()
    server = subprocess.Popen([venv.path / "bin" / "ampwatch", "dashboard", "--port", str(port)], cwd=tmp_path,
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(server, url, 90, "ampwatch dashboard")
        listening = _listening_on(port)
        assert listening and all(_loopback(a) for a in listening), listening
        # ampwatch became Streamlit (exec), serving the app installed with the wheel
        cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes().split(b"\0")
        app = venv.site_packages() / "ampwatch" / "dashboard" / "app" / "streamlit_app.py"
        assert str(app).encode() in cmdline and b"--browser.gatherUsageStats" in cmdline

        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
        from selenium.webdriver.common.by import By
        from test_browser import CHROMIUM, DRIVER
        opts = webdriver.ChromeOptions()
        opts.binary_location = CHROMIUM
        for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                     "--disable-component-update", "--disable-dev-shm-usage", "--window-size=1400,1000"):
            opts.add_argument(flag)
        browser = webdriver.Chrome(service=Service(DRIVER), options=opts)
        try:
            browser.get(url)
            _wait(browser, "h1", text="Runs")
            _wait(browser, '[data-testid="stMain"]', text=f"Folder: {tmp_path / 'runs'}")
            deadline = time.monotonic() + 60
            cells: list = []
            while time.monotonic() < deadline and "healthy_fp16" not in cells:
                cells = [c.get_attribute("textContent")
                         for c in browser.find_elements(By.CSS_SELECTOR, '[data-testid="stDataFrame"] td')]
                time.sleep(0.3)
            assert "healthy_fp16" in cells and "finished" in cells, cells  # the run's row, and its status
            _no_errors(browser)
            ARTIFACTS.mkdir(exist_ok=True)
            browser.save_screenshot(str(ARTIFACTS / "dashboard_from_wheel.png"))
            browser.get(f"{url}/overview?run=healthy_fp16.sqlite")  # Plotly, from the extra, draws
            _wait(browser, "h1", text="healthy_fp16")
            _wait(browser, ".js-plotly-plot .main-svg")
            _no_errors(browser)
        finally:
            browser.quit()
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()


def test_an_editable_install_finds_the_repositorys_app(sources, tmp_path):
    venv = _new_venv(tmp_path / "v", with_torch=False)
    venv.pip("--no-deps", "-e", str(sources), "click")
    found = _run([venv.python, "-c", "from ampwatch.dashboard.launch import app_script; print(app_script())"],
                 cwd=tmp_path).stdout.strip()
    assert found == str(sources / "app" / "streamlit_app.py")
    done = _run([venv.path / "bin" / "ampwatch", "dashboard", str(tmp_path)], cwd=tmp_path, check=False)
    assert (done.returncode, done.stderr.strip().splitlines()) == (2, [
        f"ampwatch: the dashboard needs streamlit and plotly, which this Python lacks: {DASHBOARD_HINT}"])
