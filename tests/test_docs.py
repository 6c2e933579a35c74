"""The docs a clone has are whole: every file README.md and docs/*.md link to
or name by its path in the repository is there, inside the repository (no
``../`` to a file a clone lacks)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

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


# The node commands whose options docs/usage.md describes (README: a line and a link).
OPTIONS_IN_USAGE = ("daemon", "up", "down", "run", "commit")


def usage_section(command: str) -> str:
    usage = (ROOT / "docs" / "usage.md").read_text()
    return usage.split(f"### `layerfs {command}`\n", 1)[1].split("\n## ", 1)[0].split("\n### ")[0]


@pytest.mark.parametrize("command", OPTIONS_IN_USAGE)
def test_a_node_commands_options_are_described_in_one_place(command):
    """README's table gives the command a short line and a link; its options'
    details are docs/usage.md's (and the one-line ``--help``), where every
    option the command has is named."""
    import click

    from layerfs.cli.group import cli

    readme = (ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith(f"| `layerfs {command} "))
    assert f"(docs/usage.md#layerfs-{command})" in row and len(row.split("|")[2]) < 300, row
    cmd = cli.get_command(click.Context(cli), command)
    assert cmd is not None
    generic = {"--root", "--store", "--s3-endpoint", "--json", "--log-level", "--help", "-h",
               "--live-restart", "--name", "--version", "--layer", "--id", "--role"}
    options = {o for p in cmd.params for o in [*p.opts, *p.secondary_opts] if o.startswith("--")}
    section = usage_section(command)
    assert sorted(o for o in options - generic if f"{o}" not in section) == []
