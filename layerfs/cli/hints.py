"""What a usage error line adds for a newcomer's likely slip: values given
after an option that is repeated for each (``--layer A B C``). (A registry
that answers plain HTTP to TLS is named in the registry's own error:
``layerfs/builder/oci/registry.py``.)"""

from __future__ import annotations

from collections.abc import Sequence

TYPE_CHECKING = False  # (click is imported by the caller only)
if TYPE_CHECKING:
    import click

EXTRA_ARGUMENTS = "unexpected extra argument"  # click's "Got unexpected extra argument(s) (...)"


def repeat_hint(args: Sequence[str], command: click.Command | None) -> str | None:
    """For click's extra-arguments error: the hint to repeat the option that
    is given once per value (``multiple``), if ``args`` has one followed by
    several plain words: ``repeat --layer for each value: --layer A --layer B``."""
    if command is None:
        return None
    cut = list(args).index("--") if "--" in args else len(args)
    for param in command.params:
        if not getattr(param, "multiple", False) or getattr(param, "is_flag", False):
            continue
        for name in getattr(param, "opts", ()):
            if not name.startswith("--"):
                continue
            values = values_after(list(args[:cut]), name)
            if len(values) > 1:
                shown = " ".join(f"{name} {v}" for v in values)
                return f"repeat {name} for each value: {shown}"
    return None


def values_after(args: list[str], option: str) -> list[str]:
    """The words that follow each ``option`` in ``args`` up to the next option
    (its own value first)."""
    found: list[str] = []
    for k, arg in enumerate(args):
        if arg != option:
            continue
        for word in args[k + 1:]:
            if word.startswith("-"):
                break
            found.append(word)
    return found
