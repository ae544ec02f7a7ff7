"""What a results file says of where its figures come from: the date and the commit of the
checkout that measured them ("+" after it when its tracked files outside docs/ differ from
that commit, so a figure of uncommitted code says so; the results files a run writes into
docs/ do not count)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the checkout charengine/ is in


def commit() -> str:
    """This checkout's short commit, "+" after it when its tracked files outside docs/ differ
    from it; "unknown" outside a git checkout."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)

    head = git("rev-parse", "--short", "HEAD")
    if head.returncode != 0:
        return "unknown"
    dirty = git("diff", "--quiet", "HEAD", "--", ".", ":(exclude)docs").returncode == 1
    return head.stdout.strip() + ("+" if dirty else "")


def provenance() -> dict[str, str]:
    """The date (UTC) and the commit, for a results file."""
    return {"date": time.strftime("%Y-%m-%d", time.gmtime()), "commit": commit()}
