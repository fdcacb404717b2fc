"""The README and docs/ as a user meets them: links resolve, commands name scripts that exist."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
SCRIPT = re.compile(r"python (?:-m )?((?:benchmarks|experiments|examples)/[\w/]+\.py)")


def test_every_relative_link_resolves():
    assert len(PAGES) >= 6
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_every_script_a_page_names_exists_and_each_record_names_how_to_reproduce_it():
    missing = []
    for page in PAGES:
        for script in SCRIPT.findall(page.read_text()):
            if not (ROOT / script).is_file():
                missing.append(f"{page.relative_to(ROOT)}: {script}")
    assert not missing, missing
    for page in (ROOT / "docs").glob("*.md"):
        if page.name != "design.md":  # the one page that is not a measurement record
            assert "Reproduce" in page.read_text() and SCRIPT.search(page.read_text()), f"{page.name} names no command"


def test_readme_is_short_and_keeps_the_two_setup_commands_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    commands = [line for line in readme.splitlines() if line.startswith("python3 -m venv .venv")]
    assert len(commands) == 2 and commands[0].endswith("kvq demo")
    # CI makes its venv, then runs the README's test command
    assert commands[1].split(". .venv/bin/activate && ", 1)[1] in (ROOT / ".ci" / "run").read_text()
