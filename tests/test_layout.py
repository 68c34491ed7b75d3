"""The package's import rules, checked over its own source (every import, lazy ones inside functions
included), the way test_docs.py checks the README: data flows record -> store -> jobs/doctor -> faces.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ampwatch"

READ_SIDE = ("ampwatch.store", "ampwatch.jobs", "ampwatch.doctor", "ampwatch.dashboard")
FACES = ("ampwatch.doctor", "ampwatch.jobs", "ampwatch.cli", "ampwatch.dashboard", "ampwatch.samples",
         "ampwatch.integrations", "ampwatch.trackers")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str) -> list[tuple[str, str, int]]:
    """(imported module, imported name or '', line) for every import in the module's source."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, "", node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                # `from . import torch_access` imports a module: record the edge to it
                sub = f"{module}.{alias.name}"
                found.append((sub, "", node.lineno) if sub in MODULES else (module, alias.name, node.lineno))
    return found


def _violations(rule) -> list[str]:
    return [f"{MODULES[m].relative_to(PACKAGE.parent)}:{line} imports {target}{'.' + what if what else ''}"
            for m in MODULES for target, what, line in _imports(m) if rule(m, target, what)]


def _within(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_the_read_side_imports_neither_the_recorder_nor_torch():
    assert _violations(lambda m, t, _: _within(m, READ_SIDE)
                       and (_within(t, ("ampwatch.record",)) or _within(t, ("torch",)))) == []


def test_the_recorder_imports_no_analysis_and_no_face():
    assert _violations(lambda m, t, _: _within(m, ("ampwatch.record",)) and _within(t, FACES)) == []


def test_the_doctor_neither_draws_nor_prints():
    assert _violations(lambda m, t, _: _within(m, ("ampwatch.doctor",))
                       and _within(t, ("plotly", "streamlit", "click", "ampwatch.cli", "ampwatch.dashboard"))) == []
    printing = [f"{MODULES[m]}:{n.lineno}" for m in MODULES if _within(m, ("ampwatch.doctor",))
                for n in ast.walk(ast.parse(MODULES[m].read_text()))
                if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "print"]
    assert printing == []


def test_streamlit_only_in_the_app_and_plotly_only_in_the_figures():
    assert _violations(lambda m, t, _: _within(t, ("streamlit",))) == []
    assert _violations(lambda m, t, _: _within(t, ("plotly",)) and m != "ampwatch.dashboard.figures") == []


def test_no_module_imports_another_modules_private_names():
    assert _violations(lambda m, t, what: _within(t, ("ampwatch",)) and what.startswith("_")
                       and not what.startswith("__")) == []


def test_no_import_circles():
    graph = {m: {t for t, _, _ in _imports(m) if t in MODULES and t != m} for m in MODULES}
    # the package's own __init__ re-exports lazily and everything may use the public API: not an edge back
    graph = {m: {t for t in ts if t != "ampwatch"} for m, ts in graph.items()}
    circles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert circles == []


@pytest.mark.parametrize("folder", ["record", "store", "jobs", "doctor", "cli", "dashboard", "integrations", "samples",
                                    "trackers"])
def test_each_room_says_what_it_holds(folder):
    init = PACKAGE / folder / "__init__.py"
    assert init.exists() and ast.get_docstring(ast.parse(init.read_text())), f"{folder}/__init__.py needs a docstring"


def test_no_module_lies_flat_beside_the_rooms_but_the_public_api_and_its_errors():
    flat = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert flat == ["__init__.py", "__main__.py", "_version.py", "errors.py", "userpath.py"]


def test_no_bench_script_stands_in_for_a_module_a_library_imports(tmp_path):
    """``python bench/x.py`` puts bench/ first on ``sys.path``, so a script there named like a module
    that a library imports is imported in its place. transformers looks for Hugging Face's
    ``kernels`` when it builds a model: bench/kernels.py (now inductor_kernels.py) was executed
    then, and its first line switched every bench on GPT-2 to the accelerator path, ``--path cpu``
    included. Built here as the benches build it, in a process of its own: no module from bench/."""
    pytest.importorskip("transformers")
    import subprocess
    import sys
    bench = str(PACKAGE.parent / "bench")
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from transformers import GPT2Config, GPT2LMHeadModel\n"
        "GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8))\n"
        "print([n for n, m in list(sys.modules.items()) if (getattr(m, '__file__', None) or '').startswith(sys.argv[1])])\n")
    done = subprocess.run([sys.executable, "-c", probe, bench], capture_output=True, text=True, cwd=tmp_path,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_only_the_store_asks_which_tables_a_run_file_has():
    """Whether a run file has a table (files of older schemas lack the newer ones) was asked with the
    same SQL in five places (the memory table's readers in the store, the dashboard and the
    trackers, the fp8 page, the doctor's facts); they now share ``store.reader.has_table``."""
    asking = [str(p.relative_to(PACKAGE.parent)) for m, p in MODULES.items()
              if not _within(m, ("ampwatch.store",)) and "sqlite_master" in p.read_text()]
    assert asking == []
