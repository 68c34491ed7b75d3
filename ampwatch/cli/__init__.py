"""The ``ampwatch`` command line (:mod:`.main`) and its plain-text formatting (:mod:`.report`,
:mod:`.job_report`). Thin: parse, call the library, print. Bad input: one line, exit 2."""
from .main import main

__all__ = ["main"]
