"""End to end in a real headless Chromium: `streamlit run app` on a free port, charts drawn, a run picked.

Skipped when Chromium or chromedriver is missing, unless AMPWATCH_REQUIRE_BROWSER=1 (CI), which
turns the skip into a failure. The screenshot lands in test-artifacts/.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.servers import wait_until_healthy

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or "/usr/bin/chromium"
DRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"

pytestmark = pytest.mark.browser


def _require_browser() -> None:
    missing = [p for p in (CHROMIUM, DRIVER) if not Path(p).exists()]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("selenium")
    if missing:
        message = f"browser test needs {', '.join(missing)} (Debian: apt install chromium chromium-driver)"
        if os.environ.get("AMPWATCH_REQUIRE_BROWSER") == "1":
            pytest.fail(message)
        pytest.skip(message)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    _require_browser()
    port = _free_port()
    env = dict(os.environ, AMPWATCH_RUNS="sample_runs")
    proc = subprocess.Popen([sys.executable, "-m", "streamlit", "run", "app", "--server.port", str(port),
                             "--server.headless", "true"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(proc, url, 60, "streamlit")
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def browser():
    _require_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-dev-shm-usage", "--window-size=1400,1800"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    yield driver
    driver.quit()


def _wait(driver, css: str, timeout: float = 60, text: str | None = None):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait
    wait = WebDriverWait(driver, timeout)
    if text is None:
        return wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, css)))
    return wait.until(ec.text_to_be_present_in_element((By.CSS_SELECTOR, css), text))


def _no_errors(driver) -> None:
    from selenium.webdriver.common.by import By
    bad = driver.find_elements(By.CSS_SELECTOR, '[data-testid="stException"], .stException')
    assert not bad, [e.text[:300] for e in bad]


def test_dashboard_in_chromium(server, browser):
    from selenium.webdriver.common.by import By
    browser.get(f"{server}/overview?run=healthy_fp16.sqlite")
    _wait(browser, "h1", text="healthy_fp16")
    _wait(browser, ".js-plotly-plot .main-svg")  # Plotly really drew the charts
    _no_errors(browser)

    # select another run in the sidebar's picker, as a person would
    box = _wait(browser, '[data-testid="stSidebar"] [data-testid="stSelectbox"]')
    box.find_element(By.CSS_SELECTOR, "input, [role='combobox']").click()
    option = _wait(browser, '[role="option"]')
    options = browser.find_elements(By.CSS_SELECTOR, '[role="option"]')
    next(o for o in options if "overflow_storm" in o.text).click()
    _wait(browser, "h1", text="overflow_storm")
    _wait(browser, ".js-plotly-plot .main-svg")
    assert option is not None and "run=overflow_storm.sqlite" in browser.current_url
    # the previous run's elements stay until replaced: wait for this run's doctor (healthy_fp16 has only notes)
    _wait(browser, '[data-testid="stMain"]', text="Root causes")
    text = browser.find_element(By.TAG_NAME, "body").text
    assert "Root causes" in text and "skipped" in text
    _no_errors(browser)
    ARTIFACTS.mkdir(exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / "dashboard_overview.png"))
    assert (ARTIFACTS / "dashboard_overview.png").stat().st_size > 10_000

    # a run without GradScaler: the scale panel says so inside itself, and the step axis starts at step 0
    # (the note anchored to the dropped axes of that empty panel stretched it to -70)
    browser.get(f"{server}/overview?run=bf16_noscaler.sqlite")
    _wait(browser, "h1", text="bf16_noscaler")
    _wait(browser, ".js-plotly-plot .main-svg")
    time.sleep(1)
    low, note_y = browser.execute_script(
        "const L = document.querySelector('.js-plotly-plot')._fullLayout;"
        " const a = L.annotations.find(a => a.text.includes('no loss scale'));"
        " return [L.xaxis.range[0], a.yref === 'paper' ? a.y : -1];")
    assert low >= -3, low  # at most a few steps of padding, not -70
    assert 0.45 < note_y < 0.7, note_y  # the scale panel's band of the page, below the loss panel
    _no_errors(browser)

    browser.get(f"{server}/layers?run=diverged.sqlite")
    _wait(browser, "h1", text="Layers")
    _wait(browser, ".js-plotly-plot .main-svg")
    _no_errors(browser)
    browser.save_screenshot(str(ARTIFACTS / "dashboard_layers.png"))


def test_live_drag_zoom_survives_redraws(server, browser, tmp_path):
    """A drag on the Live chart is the view kept while a growing run redraws (Streamlit mounts a
    changed chart anew, so Plotly's own zoom would reset every few seconds)."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.keys import Keys
    from test_app import _append, _make_run
    path = _make_run(tmp_path / "grow.sqlite", [1.0 - 0.005 * i for i in range(60)], status="running")
    browser.get(f"{server}/live")
    box = _wait(browser, '[data-testid="stSidebar"] input[aria-label="Runs folder"]')
    box.send_keys(Keys.CONTROL, "a", Keys.DELETE)
    box.send_keys(str(tmp_path), Keys.ENTER)
    _wait(browser, '[data-testid="stMain"]', text="redrawing every")

    def x_range():
        return browser.execute_script("const p=document.querySelector('.js-plotly-plot');"
                                      " return p ? p._fullLayout.xaxis.range : null;")

    time.sleep(1)
    for attempt in range(5):  # the live page redraws: the chart found may be replaced before the drag
        plot = _wait(browser, ".js-plotly-plot .nsewdrag")
        try:
            width = plot.size["width"]
            ActionChains(browser).move_to_element_with_offset(plot, -width // 2 + 60, 0).click_and_hold() \
                .move_by_offset(80, 0).move_by_offset(80, 2).release().perform()
            break
        except StaleElementReferenceException:
            time.sleep(0.5)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (x_range() and x_range()[1] - x_range()[0] < 40):
        time.sleep(0.3)
    zoomed = x_range()
    assert zoomed[1] - zoomed[0] < 40, zoomed
    _append(path, 60, [0.5] * 40)
    _wait(browser, '[data-testid="stMain"]', text="100", timeout=30)  # the redraw with the new steps
    time.sleep(1)
    assert x_range() == zoomed
    _no_errors(browser)


def test_live_sidebar_steps_follow_a_growing_run(server, browser, tmp_path):
    """Only the chart area reruns on the Live page, so the sidebar's Steps slider stayed at the steps
    of the first draw (0-59 with the chart at 0-99), and a touch of it narrowed the view to 59."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from test_app import _append, _make_run
    path = _make_run(tmp_path / "grow.sqlite", [1.0 - 0.005 * i for i in range(60)], status="running")
    browser.get(f"{server}/live")
    box = _wait(browser, '[data-testid="stSidebar"] input[aria-label="Runs folder"]')
    box.send_keys(Keys.CONTROL, "a", Keys.DELETE)
    box.send_keys(str(tmp_path), Keys.ENTER)
    _wait(browser, '[data-testid="stMain"]', text="redrawing every")
    slider = '[data-testid="stSidebar"] [data-testid="stSlider"]'
    _wait(browser, slider, text="59")
    _append(path, 60, [0.5] * 40)
    _wait(browser, '[data-testid="stMain"]', text="100", timeout=30)  # the chart area has the new steps
    _wait(browser, slider, text="99", timeout=30)  # and the sidebar catches up
    assert browser.find_element(By.CSS_SELECTOR, slider).text.split()[-2:] == ["0", "99"]
    _no_errors(browser)


def test_runs_health_fills_in_by_itself(server, browser, tmp_path):
    """A long run's health is read in the background: the Runs page draws its table first, says the
    doctor is reading, and redraws itself when it is done (a timer of the page's own, which AppTest
    does not run)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from test_app import _make_run
    _make_run(tmp_path / "long.sqlite", [1.0 - 1e-6 * i for i in range(80_000)])  # past INLINE_DOCTOR_STEPS
    browser.get(server)  # the Runs page is the app's main page
    _wait(browser, '[data-testid="stDataFrame"]')  # the sample runs' table: the page is drawn
    box = _wait(browser, '[data-testid="stSidebar"] input[aria-label="Runs folder"]')
    box.send_keys(Keys.CONTROL, "a", Keys.DELETE)
    box.send_keys(str(tmp_path), Keys.ENTER)
    main = '[data-testid="stMain"]'
    _wait(browser, main, text="The doctor is reading 1 run in the background (long.sqlite)")
    assert browser.find_elements(By.CSS_SELECTOR, '[data-testid="stDataFrame"]')  # the table is there already
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "The doctor is reading" in browser.find_element(By.CSS_SELECTOR, main).text:
        time.sleep(0.3)
    text = browser.find_element(By.CSS_SELECTOR, main).text
    assert "The doctor is reading" not in text and "Select rows to open a run" in text
    _no_errors(browser)
