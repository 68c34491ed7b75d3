"""Which packages the wheel holds; everything else about the project is in pyproject.toml.

The Streamlit app lives in app/ at the repository root, so that `streamlit run app` works from a
clone. The wheel ships the same files as ampwatch/dashboard/app/, where `ampwatch dashboard`
finds them once installed (ampwatch/dashboard/launch.py): package-dir maps that package onto
app/, which pyproject.toml's package discovery cannot do for a folder outside ampwatch/.
"""
from pathlib import Path

from setuptools import find_namespace_packages, setup

APP = "ampwatch.dashboard.app"
HERE = Path(__file__).resolve().parent
app_folders = sorted(d for d in (HERE / "app").iterdir() if d.is_dir() and any(d.glob("*.py")))

setup(
    packages=find_namespace_packages(include=["ampwatch", "ampwatch.*"], exclude=["*.__pycache__"])
    + [APP] + [f"{APP}.{d.name}" for d in app_folders],
    package_dir={APP: "app"},
)
