"""The README, docs/ and CONTRIBUTING.md stay true: every command documented with --help, every option
in the API page's table, the set-up commands the Makefile's, examples that are real output, cost
figures with their machine and command, links that resolve, and files, modules and tests that exist."""
import re
import unicodedata
from pathlib import Path

import pytest
from click.testing import CliRunner

import ampwatch
from ampwatch.cli.main import cli
from ampwatch.record.options import SETTINGS

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
API = (ROOT / "docs" / "api.md").read_text()
PERFORMANCE = (ROOT / "docs" / "performance.md").read_text()
CONTRIBUTING = (ROOT / "CONTRIBUTING.md").read_text()
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


def _section(text: str, heading: str) -> str:
    """The lines under ``heading`` up to the next heading of the same or a higher level."""
    level = len(heading) - len(heading.lstrip("#"))
    lines = text.splitlines()
    start = lines.index(heading) + 1
    end = next((i for i in range(start, len(lines))
                if re.match(rf"#{{1,{level}}} ", lines[i])), len(lines))
    return "\n".join(lines[start:end])


def _table_rows(text: str) -> list[list[str]]:
    """The body rows of the Markdown tables in ``text``, as lists of stripped cells."""
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not re.match(r"\|\s*-", line):
            rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
    return rows


def _code_blocks(text: str) -> list[str]:
    return re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def test_every_command_in_readme_with_help_and_example():
    for name, command in cli.commands.items():
        assert f"ampwatch {name}" in README, name
        result = CliRunner().invoke(cli, [name, "--help"])
        assert result.exit_code == 0 and "Example" in result.output


def test_every_option_in_the_api_options_table_with_its_default():
    rows = {row[0]: row[1] for row in _table_rows(_section(API, "## Options")) if row[0] != "option"}
    assert set(rows) == {f"`{s.name}`" for s in SETTINGS}
    for setting in SETTINGS:
        assert rows[f"`{setting.name}`"] == str(setting.default), setting.name


def test_readme_setup_commands_are_the_makefiles():
    setup = _section(README, "## Set-up: two commands")
    assert "make test" in setup and "make demo" in setup
    assert "torch==2.13.0" in setup
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert "pip install -q torch==2.13.0" in makefile
    assert "make test" in (ROOT / ".ci" / "run").read_text()  # CI runs the README's test command


def test_readme_stays_short():
    assert len(README.splitlines()) <= 250


def test_no_tracker_references():
    for page in PAGES:
        found = re.findall(r"\bissues? \d+\b", page.read_text(), flags=re.I)
        assert not found, f"{page.name}: {found}"


def test_relative_links_resolve():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            assert linked.exists(), f"{page.name} links to missing {target}"
            if anchor:
                headings = re.findall(r"^#+ (.+)$", linked.read_text(), flags=re.M)
                assert anchor in {_slug(h) for h in headings}, f"{page.name}: no heading for {target}"


def _bench_commands(text: str) -> list[tuple[str, str]]:
    """(script, the options written after it) for every ``bench/<name>.py`` command in ``text``."""
    return re.findall(r"bench/(\w+)\.py((?:[ \t]+--?[\w-]+(?:[ \t]+[\w.,=-]+)?)*)", text)


def test_documented_bench_commands_exist_with_their_options():
    commands = [c for page in PAGES for c in _bench_commands(page.read_text())]
    assert len(commands) > 20
    for script, options in commands:
        source = ROOT / "bench" / f"{script}.py"
        assert source.exists(), script
        for option in re.findall(r"--[\w-]+", options):
            assert f'"{option}"' in source.read_text(), f"bench/{script}.py has no {option}"


def test_every_benchmark_in_contributing():
    for script in sorted((ROOT / "bench").glob("*.py")):
        assert f"`{script.name}`" in CONTRIBUTING, script.name


def test_readme_cost_table_gives_machine_and_command():
    rows = _table_rows(_section(README, "## What it costs"))
    header, body = rows[0], rows[1:]
    assert header == ["what", "figure", "machine", "command"]
    assert len(body) >= 5
    for what, figure, machine, command in body:
        assert re.search(r"\d", figure) and machine, what
        assert re.fullmatch(r"`python bench/\w+\.py[^`]*`", command), what
        # every figure in the README is one of the current figures on the performance page
        for number in re.findall(r"\d[\d,.]*\d|\d", figure.replace("**", "")):
            assert number in PERFORMANCE, (what, number)


def test_performance_tables_name_their_command():
    for heading in re.findall(r"^## .+$", PERFORMANCE, flags=re.M):
        section = _section(PERFORMANCE, heading)
        if "|" in section:
            assert "bench/" in section, heading


def _example(text: str, command: str) -> list[str]:
    """The output lines shown under ``$ command`` in the code blocks of ``text``."""
    for block in _code_blocks(text):
        lines = block.splitlines()
        if f"$ {command}" in lines:
            start = lines.index(f"$ {command}") + 1
            end = next((i for i in range(start, len(lines)) if lines[i].startswith("$ ")), len(lines))
            return [line for line in lines[start:end] if line.strip()]
    raise AssertionError(f"no example of {command!r}")


@pytest.mark.parametrize("args", [["summary", "sample_runs/diverged.sqlite"],
                                  ["doctor", "sample_runs/diverged.sqlite"]])
def test_readme_cli_examples_are_real_output(args, monkeypatch):
    monkeypatch.chdir(ROOT)
    output = CliRunner().invoke(cli, args).output
    shown = _example(README, "ampwatch " + " ".join(args))
    assert len(shown) >= 6
    for line in shown:
        # "..." marks what the README trimmed; every piece around it is verbatim output
        for piece in line.split("..."):
            assert piece.strip() in output, piece


def test_localization_example_is_real_output():
    page = (ROOT / "docs" / "localization.md").read_text()
    shown = next(b for b in _code_blocks(page) if "e[e.origin]" in b).splitlines()[-2:]
    e = ampwatch.load(ROOT / "sample_runs" / "diverged.sqlite").events
    columns = ["step", "phase", "module", "kind", "count", "dtype", "micro_batch", "fp32_amax"]
    assert e[e.origin][columns].head(1).to_string().splitlines() == shown


def test_named_files_and_modules_exist():
    """Every repository file and dotted ampwatch module a page names exists (the re-layout moved many)."""
    for page in PAGES:
        text = page.read_text()
        for path in re.findall(r"(?<![\w/.])((?:ampwatch|app|tests|bench|examples)/[\w/]+\.py)", text):
            assert (ROOT / path).exists(), f"{page.name} names missing {path}"
        for dotted in re.findall(r"`(ampwatch(?:\.\w+)+)", text):
            parts = dotted.split(".")
            # the longest prefix that is a module or package; the next name must be defined in it
            for n in range(len(parts), 0, -1):
                base = ROOT.joinpath(*parts[:n])
                source = base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"
                if source.exists():
                    break
            if n < len(parts):
                assert re.search(rf"\b{parts[n]}\b", source.read_text()), f"{page.name}: no {dotted}"


def test_named_tests_exist():
    sources = "".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py"))
    for page in PAGES:
        for name in re.findall(r"`(test_\w+)`", page.read_text()):
            assert f"def {name}(" in sources, f"{page.name} names missing test {name}"
