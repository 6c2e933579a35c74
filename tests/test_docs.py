"""The docs a clone has are whole: every file README.md and docs/*.md link to
or name by its path in the repository is there, inside the repository (no
``../`` to a file a clone lacks)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
# a backticked file of the repository: one of its top folders (or ../), then a
# file name with an extension (a folder may be ROOT's: cache/tmp/)
NAMED = re.compile(r"`((?:\.\./)+[\w./-]+\.\w+|(?:docs|layerfs|tools|builder|cache|bench|tests|"
                   r"deploy|harness)/[\w./-]*\.\w+)`")
PLACEHOLDER = re.compile(r"[A-Z]{3,}")  # bench/results/walk-COMMIT.json: a name a run makes


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def missing_in(page: Path) -> list[str]:
    """The links and named paths of ``page`` that a clone does not have."""
    text = page.read_text()
    wrong = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path = (page.parent / target).resolve()
        if not path.is_relative_to(ROOT) or not path.exists():
            wrong.append(f"link {target}")
    for named in NAMED.findall(text):
        if PLACEHOLDER.search(named):
            continue
        base = page.parent if named.startswith("../") else ROOT
        path = (base / named).resolve()
        if not path.is_relative_to(ROOT) or not (path.exists() or "*" in named):
            wrong.append(f"path {named}")
    return wrong


def test_every_linked_or_named_file_is_in_the_repository():
    wrong = {page.name: missing for page in pages() if (missing := missing_in(page))}
    assert wrong == {}


def test_the_design_and_formats_pages_are_in_the_clone():
    readme = (ROOT / "README.md").read_text()
    assert "[docs/design.md](docs/design.md)" in readme
    assert "[docs/formats.md](docs/formats.md)" in readme
    assert "shared/" not in readme
