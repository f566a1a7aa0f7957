"""The README is the front door: it stays short, its AlexNet figures are those of the committed
results/alexnet_4gb/summary.json (a search run again into that folder changes its timings alone), and every
relative link in it and in docs/ leads to a file that exists (and, for a link to a heading, to that heading). Reads
text files only: no torch."""
from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RESULTS = ROOT / "results" / "alexnet_4gb"
MAX_LINES = 300


def _summary() -> dict:
    """The committed results/alexnet_4gb/summary.json: git's copy at HEAD where there is one (the README's search,
    run as it says, writes the folder anew, its timings the run's own), else the file."""
    import subprocess

    path = (RESULTS / "summary.json").relative_to(ROOT).as_posix()
    try:
        shown = subprocess.run(["git", "-C", str(ROOT), "show", f"HEAD:{path}"], capture_output=True, text=True,
                               timeout=30)
    except (OSError, subprocess.SubprocessError):
        shown = None
    return json.loads(shown.stdout if shown is not None and shown.returncode == 0 else (ROOT / path).read_text())


def _section(text: str, heading: str) -> str:
    """The lines under `## heading`, up to the next heading of level 2 or above."""
    match = re.search(rf"^## {re.escape(heading)}[ \t]*\n(.*?)(?=^#{{1,2}} |\Z)", text, re.M | re.S)
    assert match, f"README.md has no '## {heading}' section"
    return match.group(1)


def _tables(text: str) -> list[list[list[str]]]:
    """Each pipe table of `text` as its rows of stripped cells, header included, separator row left out."""
    tables, rows = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                rows.append(cells)
        elif rows:
            tables.append(rows)
            rows = []
    return tables


# The figures as the README writes them (decimal units, as gaswap prints them).
def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _pct(fraction: float) -> str:
    return f"{fraction * 100:+.1f}%"


def _policy_row(entry: dict, budget_bytes: int) -> list[str]:
    over = " (over budget)" if entry["peak_bytes"] > budget_bytes else ""
    return [_gb(entry["peak_bytes"]) + over, _ms(entry["step_time_s"]), _pct(entry["overhead"]),
            f"{entry['keep']}/{entry['swap']}/{entry['recompute']}"]


def expected_policies(summary: dict) -> dict[str, list[str]]:
    seeds, budget = summary["seeds"], summary["budget_bytes"]
    return {
        "keep-all": _policy_row(seeds["keep_all"], budget),
        "recompute-all": _policy_row(seeds["recompute_all"], budget),
        "swap-all": _policy_row(seeds["swap_all"], budget),
        "min-cut": _policy_row(seeds["min_cut"], budget),
        "best (GA)": _policy_row(summary["best"], budget),
    }


def expected_search(summary: dict) -> dict[str, str]:
    graph = summary["graph"]
    return {
        "budget": _gb(summary["budget_bytes"]),
        "graph": f"{graph['ops']} ops, {graph['tensors']} tensors, {graph['candidates']} candidate activations",
        "capture": f"{summary['capture_seconds']:.2f} s",
        "generations": f"{summary['generations_done']} of at most {summary['generations']}, "
                       f"stopped by {summary['stopped_by']}",
        "evaluations": str(summary["evaluations"]),
        "search time": f"{summary['search_seconds']:.1f} s",
        "policies on the front": str(summary["front_size"]),
    }


def differences(readme_text: str, summary: dict) -> list[str]:
    """Where the AlexNet tables of `readme_text` differ from `summary`: a row or cell each."""
    tables = _tables(_section(readme_text, "The AlexNet result"))
    if len(tables) != 2:
        return [f"the AlexNet section holds {len(tables)} tables, not two (the policies, then the search)"]
    policies, search = tables
    found = []
    if policies[0] != ["policy", "peak", "step time", "overhead", "keep/swap/recompute"]:
        found.append(f"policy table header {policies[0]}")
    rows = {row[0]: row[1:] for row in policies[1:]}
    expected = expected_policies(summary)
    if list(rows) != list(expected):
        found.append(f"policy rows {list(rows)}, expected {list(expected)}")
    for policy, cells in expected.items():
        if policy in rows and rows[policy] != cells:
            found.append(f"{policy}: {rows[policy]}, summary.json gives {cells}")
    got = {row[0]: row[1] for row in search[1:]}
    for key, value in expected_search(summary).items():
        if got.get(key) != value:
            found.append(f"search {key}: {got.get(key)!r}, summary.json gives {value!r}")
    if set(got) - set(expected_search(summary)):
        found.append(f"search rows not from summary.json: {sorted(set(got) - set(expected_search(summary)))}")
    counts = re.findall(r"GA front \((\d+) policies", _section(readme_text, "The AlexNet result"))
    if counts != [str(summary["front_size"])]:
        found.append(f"the figure's paragraph counts {counts} front policies, summary.json {summary['front_size']}")
    return found


def test_readme_is_at_most_300_lines():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_LINES, f"README.md has {lines} lines; depth goes to docs/, history to CHANGELOG.md"


def test_alexnet_tables_are_the_summary():
    summary = _summary()
    assert summary["experiment"] == "alexnet_4gb" and summary["complete"]
    assert summary["budget"] == _gb(summary["budget_bytes"])
    with open(RESULTS / "front.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == summary["front_size"]
    assert differences(README.read_text(), summary) == []
    # a search run again into the folder (as the README says) gives the same figures but its timings
    here = json.loads((RESULTS / "summary.json").read_text())
    timings = {"capture_seconds", "costs_seconds", "search_seconds"}
    assert {k: v for k, v in here.items() if k not in timings} == {k: v for k, v in summary.items() if k not in timings}


def test_an_edited_figure_is_caught():
    """Each figure of the tables, one digit changed in README's text, is a difference."""
    text, summary = README.read_text(), _summary()
    section = _section(text, "The AlexNet result")
    figures = [cell for table in _tables(section) for row in table[1:] for cell in row[1:]
               if re.search(r"\d", cell)]
    assert len(figures) == 5 * 4 + 7
    for cell in figures:
        digit = re.search(r"\d", cell)
        edited_cell = cell[:digit.start()] + str((int(digit.group()) + 1) % 10) + cell[digit.end():]
        edited = text.replace(section, section.replace(f"| {cell} |", f"| {edited_cell} |", 1), 1)
        assert edited != text, cell
        assert differences(edited, summary), f"editing {cell!r} to {edited_cell!r} went unnoticed"


# ---- links ----------------------------------------------------------------------------------------

def _markdown_files() -> list[Path]:
    return [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]


def _strip_fences(text: str) -> str:
    """`text` without its fenced code blocks."""
    return re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.M | re.S)


def _prose(text: str) -> str:
    """`text` without fenced code blocks and inline code, where brackets are not links."""
    return re.sub(r"`[^`\n]*`", "", _strip_fences(text))


LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _links(path: Path) -> list[str]:
    return LINK.findall(_prose(path.read_text()))


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of the headings of a Markdown file."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", _strip_fences(path.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_markdown_files_exist():
    for path in _markdown_files():
        assert path.is_file(), path


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    if not path.is_file():
        pytest.skip(f"{path} is missing (test_markdown_files_exist fails)")
    broken = []
    for link in _links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", link, re.I):  # http:, https:, mailto: ...
            continue
        target, _, anchor = link.partition("#")
        resolved = (path.parent / target).resolve() if target else path
        if not resolved.exists():
            broken.append(f"{link}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{link}: no heading #{anchor} in {resolved.relative_to(ROOT)}")
    assert not broken, f"{path.relative_to(ROOT)}: " + "; ".join(broken)


def test_link_parser_finds_links():
    text = "see [a](docs/a.md#x) and ![fig](results/f.png) but not `[b](c.md)`\n```\n[d](e.md)\n```\n"
    assert LINK.findall(_prose(text)) == ["docs/a.md#x", "results/f.png"]
