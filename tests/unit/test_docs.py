"""The docs cannot drift: docs/cli.md is what the generator makes of the CLI's parser, every relative link in
README.md and docs/ reaches a file (and heading) that exists, and the README names the two commands."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def test_the_cli_reference_is_generated_from_the_parser() -> None:
    from poimen_tools.clidoc import render

    assert (REPO / "docs" / "cli.md").read_text() == render(), (
        "docs/cli.md is stale: regenerate it with `make docs` (python -m poimen_tools.clidoc > docs/cli.md)"
    )


def _prose(text: str) -> str:
    """The Markdown without fenced blocks and code spans, where a [x](y) is not a link."""
    text = re.sub(r"(?ms)^```.*?^```", "", text)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation but hyphens dropped, spaces to hyphens, -1, -2 on repeats."""
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"(?m)^#{1,6} +(.+?) *#*$", re.sub(r"(?ms)^```.*?^```", "", page.read_text())):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def links(page: Path) -> list[str]:
    return [target for target in LINK.findall(_prose(page.read_text())) if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_every_relative_link_reaches_a_file_and_heading(page: Path) -> None:
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(REPO)}")
    assert broken == [], f"{page.relative_to(REPO)} links to what does not exist: {broken}"


def test_the_link_checker_sees_links_and_headings() -> None:
    # Given the README, which links into docs/ with anchors
    targets = links(REPO / "README.md")
    # Then links are found, and GitHub's ids are computed from headings with code and punctuation
    assert "docs/architecture.md#numbers-in-input" in targets
    assert "poimen-dev" in anchors(REPO / "docs" / "cli.md")
    assert "storage-design-and-why" in anchors(REPO / "docs" / "architecture.md")


def test_the_readme_names_the_two_commands_ci_runs() -> None:
    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## The two commands\n", 1)[1].split("\n## ", 1)[0]
    assert "`make run`" in section
    assert "`make test`" in section
    assert "`make check`" in section  # the inner loop, beside them
    assert (REPO / ".ci" / "run").read_text().splitlines()[-1] == "make test"
