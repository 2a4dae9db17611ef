"""The README guides: its first lines are the two commands, the test command is exactly what CI
runs, it stays short, and every docs/ page it links exists, with the anchor it names. The docs
pages open with a summary of their numbers (issue 32); `mkdocs build --strict` in the test command
checks the links between the pages themselves."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT.joinpath("README.md").read_text()


def slug(heading: str) -> str:
    """The anchor mkdocs (Python-Markdown's toc) gives a heading."""
    text = re.sub(r"[^\w\s-]", "", re.sub(r"<[^>]+>", "", heading)).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # no headings inside code blocks
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.*)$", text, flags=re.M)}


def test_the_two_commands_open_the_readme_and_ci_runs_the_second():
    lines = README.splitlines()
    assert lines[0] == "# optq" and lines[1] == ""
    setup, tests = lines[2], lines[3]
    assert setup.startswith("    ") and setup.endswith("&& optq demo")
    assert tests.startswith("    ")
    assert tests.endswith("&& mkdocs build --strict && optq install-vllm && python -m pytest -q")
    ci = ROOT.joinpath(".ci", "run").read_text().splitlines()
    commands = [line for line in ci if line and not line.startswith("#")]
    assert commands[-1] == tests.strip()  # CI ends by running exactly the README's test command


def test_the_readme_reads_in_five_minutes():
    assert len(README.splitlines()) <= 200


def test_every_docs_link_in_the_readme_resolves():
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]+))?\)", README)
    assert len(links) >= 10
    for path, anchor in links:
        page = ROOT / path
        assert page.is_file(), path
        if anchor:
            assert anchor in anchors(page), f"{path}#{anchor}"


def test_the_slug_is_mkdocs_own():
    assert slug("Serving engines and per-layer settings") == "serving-engines-and-per-layer-settings"
    assert slug("Many processes (torch.distributed)") == "many-processes-torchdistributed"
    assert slug("`--target-bits`: what it buys") == "-target-bits-what-it-buys"


def test_every_docs_page_opens_with_a_summary_of_its_numbers():
    pages = sorted(ROOT.joinpath("docs").glob("*.md"))
    assert len(pages) >= 10
    for page in pages:
        paragraphs = page.read_text().split("\n\n")
        assert paragraphs[0].startswith("# "), page.name
        summary = paragraphs[1] + ("\n" + paragraphs[2] if paragraphs[1].endswith(":") else "")  # a list or table
        assert re.search(r"\d", summary), f"{page.name}: the opening summary has no number"
