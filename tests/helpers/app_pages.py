"""Open the real Streamlit app (AppTest) on a folder of runs, on one page."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from streamlit.testing.v1 import AppTest

APP = str(Path(__file__).resolve().parent.parent.parent / "app" / "streamlit_app.py")


def open_page(folder: Path, page: str = "runs", run: Optional[str] = None, state: Optional[dict] = None) -> AppTest:
    """The app with ``AMPWATCH_RUNS=folder``, ``run`` picked, ``state`` set, switched to ``page``
    (the test restores AMPWATCH_RUNS: the ``restore_runs_env`` fixture)."""
    os.environ["AMPWATCH_RUNS"] = str(folder)
    at = AppTest.from_file(APP, default_timeout=60)
    if run is not None:
        at.query_params["run"] = run
    at.run()
    if page != "runs":
        for k, v in (state or {}).items():
            at.session_state[k] = v
        at.switch_page(f"app_pages/{page}.py")
        at.run()
    return at
