"""The README and --help stay true: every command documented, every option in the settings table."""
from pathlib import Path

from click.testing import CliRunner

from ampwatch.cli.main import cli
from ampwatch.record.options import SETTINGS

README = (Path(__file__).parent.parent / "README.md").read_text()


def test_every_command_in_readme_with_help_and_example():
    for name, command in cli.commands.items():
        assert f"ampwatch {name}" in README, name
        result = CliRunner().invoke(cli, [name, "--help"])
        assert result.exit_code == 0 and "Example" in result.output


def test_every_option_in_readme():
    for setting in SETTINGS:
        assert f"`{setting.name}`" in README, setting.name


def test_readme_commands_exist():
    assert "make test" in README and "make demo" in README
    assert "torch==2.13.0" in README
