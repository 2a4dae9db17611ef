"""The README's test command is exactly the one CI runs."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = ROOT.joinpath("README.md").read_text().splitlines()
    commands = [line.strip() for line in readme[:6] if line.startswith("    ")]
    assert len(commands) == 2 and "optq demo" in commands[0] and "pytest" in commands[1]
    ci = ROOT.joinpath(".ci", "run").read_text().splitlines()
    assert commands[1] in [line.strip() for line in ci]
