"""ampwatch dashboard: `streamlit run app` from the repository root (issue 4). Router only."""
from pathlib import Path

import streamlit as st

import shared

# An emoji favicon: a :material/ one is fetched from fonts.gstatic.com on every load (the app stays local).
st.set_page_config(page_title="ampwatch", page_icon="📈", layout="wide")

PAGES = Path(__file__).resolve().parent / "app_pages"
pages = [
    st.Page(PAGES / "runs.py", title="Runs", icon=":material/table:", default=True),
    st.Page(PAGES / "overview.py", title="Run overview", icon=":material/show_chart:"),
    st.Page(PAGES / "layers.py", title="Layers", icon=":material/grid_on:"),
    st.Page(PAGES / "events.py", title="Events", icon=":material/bolt:"),
    st.Page(PAGES / "inspector.py", title="Step inspector", icon=":material/search:"),
    st.Page(PAGES / "compare.py", title="Compare", icon=":material/stacked_line_chart:"),
    st.Page(PAGES / "ranks.py", title="Ranks", icon=":material/hub:"),
    st.Page(PAGES / "live.py", title="Live", icon=":material/autorenew:"),
]
# the pickers first: which run is chosen decides whether the FP8 page is offered (the menu still
# sits at the top of the sidebar)
st.session_state["_folder"], st.session_state["_run"] = shared.sidebar()
if shared.has_fp8(st.session_state["_run"]):
    pages.insert(3, st.Page(PAGES / "fp8.py", title="FP8", icon=":material/memory:"))
nav = st.navigation(pages)
nav.run()
