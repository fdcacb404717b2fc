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


DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")  # hex with letters and digits
DIARY = re.compile(r"\bthis VM\b|\byesterday\b|\bthis morning\b|\bthis afternoon\b", re.IGNORECASE)


def test_docs_are_reference_pages_without_dates_commit_hashes_or_diaries():
    """What a page states is the current method and figures with their commands; when and in which
    commit something was decided is git's record, not the page's."""
    found = []
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for pattern in (DATE, HASH, DIARY):
                for match in pattern.findall(line):
                    found.append(f"{page.relative_to(ROOT)}:{number}: {match}")
    assert not found, "\n".join(found)


def test_results_hold_one_folder_per_benchmark_and_no_orphans():
    """results/ holds folders only (one per benchmark or experiment), and every file in them is
    named by a page, a benchmark or an experiment (directly, or as a companion of a named output:
    `kvq tune --out x.json` also writes x.pareto.csv and x.pareto.png)."""
    results = ROOT / "results"
    assert not [p.name for p in results.iterdir() if p.is_file()]
    sources = [*PAGES, *(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.json"),
               *(ROOT / "experiments").rglob("*.py"), *(ROOT / "kvq_ao").rglob("*.py")]  # fmt: skip
    text = "\n".join(p.read_text(errors="ignore") for p in sources)
    orphans = []
    for path in results.rglob("*"):
        if path.is_file():
            rel = path.relative_to(ROOT)
            companion = f"{rel.parent}/{path.name.split('.')[0]}."
            if str(rel) not in text and companion not in text:
                orphans.append(str(rel))
    assert not orphans, orphans


def test_readmes_quality_table_is_the_recorded_demo_run():
    """Every row of the README's preset table states what `kvq demo --json-out results/demo/demo.json`
    measured (ΔPPL, KL, agreement, bits), and the table lists every config that run evaluated."""
    import json

    recorded = {r["config"]: r for r in json.loads((ROOT / "results" / "demo" / "demo.json").read_text())["results"]}
    rows = {}
    for line in (ROOT / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 6 and cells[2].endswith("%"):
            rows[cells[0].strip("`")] = cells[2:]
    assert sorted(rows) == sorted(recorded)
    for name, r in recorded.items():
        want = [f"{100 * (r['ppl_ratio'] - 1):+.2f}%", f"{round(r['kl'], 4) + 0.0:.4f}", f"{r['token_agreement']:.3f}", f"{r['avg_bits_at_4096']:.2f}"]
        assert rows[name] == want, f"README row {name!r}: {rows[name]} but the demo run recorded {want}"
