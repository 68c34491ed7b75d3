"""The faults × what-the-doctor-says table of docs/doctor.md, as measured.

Records every (fault, architecture) run of tests/test_doctor_accuracy.py into a temporary folder and
prints one Markdown row each: the leading root cause, its consequences, and the fp32 verdict.

    PYTHONPATH=$PWD python bench/doctor_table.py
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import ampwatch  # noqa: E402
from test_doctor_accuracy import CASES, FAULTS, train  # noqa: E402


def main() -> None:
    print("| fault | arch | leading root cause (severity, id: title) | consequences attached | fp32 verdict |")
    print("| --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as folder:
        for fault, arch in CASES:
            run, _ = train(Path(folder) / f"{fault}-{arch}.sqlite", arch, **FAULTS[fault][0])
            findings = ampwatch.diagnose(run)
            root = next((f for f in findings if f.cause is None and f.severity != "info"), None)
            if root is None:
                print(f"| {fault} | {arch} | ok (nothing above info) | | |")
                continue
            cons = ", ".join(f.id for f in findings if f.cause == root.id) or "-"
            verdict = ("finite in fp32" if "finite (max" in root.evidence else
                       "NaN/inf in fp32 too" if "too: not a precision" in root.evidence else "-")
            print(f"| {fault} | {arch} | {root.severity}, `{root.id}`: {root.title} | {cons} | {verdict} |")


if __name__ == "__main__":
    main()
