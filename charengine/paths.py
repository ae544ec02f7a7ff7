"""Directories an output needs: the ones missing above it, made on request and removed
again when the output is not written (charbuild's engine directory, charrun's video)."""

from __future__ import annotations

from pathlib import Path


def missing_dirs(path: Path) -> tuple[list[Path], Path]:
    """(the directories above `path` that do not exist, innermost first; the nearest one
    that exists)."""
    missing, parent = [], Path(path).absolute().parent
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    return missing, parent


def make_dirs(missing: list[Path]) -> list[Path]:
    """Make `missing` (innermost first, as missing_dirs gives them) outermost first; returns
    those made, so remove_dirs can take them away again. Raises OSError as mkdir does, after
    removing what it had made."""
    made = []
    try:
        for d in reversed(missing):
            d.mkdir()
            made.append(d)
    except OSError:
        remove_dirs(made)
        raise
    return made


def remove_dirs(made: list[Path]) -> None:
    """Remove directories make_dirs made, innermost first, while they are empty."""
    for d in reversed(made):
        try:
            d.rmdir()
        except OSError:
            break
