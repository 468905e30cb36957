"""The README and docs/ stay true to the code and to themselves: the flags table is the one router/settings.py
renders, the README stays short and opens with its two commands, and no relative link points nowhere. Pure:
reads files, starts nothing."""
import re
from pathlib import Path

import pytest

from router.settings import FLAGS_END, FLAGS_START, flags_markdown

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 300
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")  # [text](target) and ![alt](target)
FENCE = re.compile(r"^(```|~~~)")


def prose(path: Path) -> list[str]:
    """The file's lines outside fenced code blocks (a link-like string in a command is not a link)."""
    lines, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(line.lstrip("#")) for line in prose(path) if re.match(r"#{1,6} ", line)}


def links(path: Path) -> list[str]:
    return [target for line in prose(path) for target in LINK.findall(line)
            if not re.match(r"[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto: are not ours to check


def test_readme_flags_table_is_the_one_settings_renders():
    text = README.read_text(encoding="utf-8")
    assert text.count(FLAGS_START) == 1 and text.count(FLAGS_END) == 1, \
        f"README.md needs one {FLAGS_START} ... {FLAGS_END} pair around the flags table"
    table = text.split(FLAGS_START + "\n", 1)[1].split(FLAGS_END, 1)[0]
    assert table == flags_markdown(), (
        "README.md's flags table is stale (router/settings.py changed): regenerate it with "
        "`.venv/bin/python -m router.settings --write README.md`")


def test_readme_is_short():
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_README_LINES, (
        f"README.md has {lines} lines, over {MAX_README_LINES}: move detail into docs/ (dated measurements go to "
        "docs/benchmarks-history.md)")


def test_readme_opens_with_its_two_commands():
    lines = [line for line in README.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert lines[0].startswith("# "), "README.md opens with its title"
    block = lines[1:5]
    assert block[0].strip() == "```" and block[3].strip() == "```", \
        "the first thing after README.md's title is a code block of two commands"
    assert block[1].startswith("make run") and block[2].startswith("make test"), \
        "README.md's first code block is `make run` then `make test`"


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_at_a_file(path):
    missing = []
    for target in links(path):
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            missing.append(f"{target} (no {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            missing.append(f"{target} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    assert not missing, f"{path.relative_to(ROOT)} links to what does not exist: " + "; ".join(missing)


def test_the_docs_the_readme_promises_exist():
    assert {p.name for p in DOCS} >= {"architecture.md", "operations.md", "benchmarks.md", "benchmarks-history.md",
                                      "tuning.md"}
