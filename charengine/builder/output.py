"""Where charbuild writes: the engine is built in a fresh directory beside --out and swapped
in at the end, only where --out is absent, empty or an engine directory (it holds an engine
manifest and nothing the manifest does not list). Anything else is refused, in one line,
before any work; a build that fails or is stopped leaves nothing behind (no staging
directory, no parent directory it had to create), and one that is killed leaves what the next
build to the same --out removes. One build writes an --out at a time; the engine is readable
by every user (less the umask)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from charengine.engine_format import MANIFEST
from charengine.paths import (Busy, OutputLock, current_umask, make_dirs, missing_dirs,
                              remove_dirs, remove_stale)


class OutputError(ValueError):
    pass


def engine_entries(d: Path) -> set[str] | None:
    """The top-level names an engine directory's manifest accounts for (itself and every
    file it lists), or None where `d` holds no engine manifest."""
    try:
        manifest = json.loads((d / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not (isinstance(manifest, dict) and "format_version" in manifest
            and isinstance(manifest.get("files"), dict)):
        return None
    return {MANIFEST, *(name.split("/", 1)[0] for name in manifest["files"])}


def check_out(out: Path) -> Path:
    """The absolute --out charbuild may replace; refuses any other in one line."""
    if out.is_symlink():
        raise OutputError(f"--out {out}: is a symbolic link; name the directory itself")
    path = Path(os.path.abspath(out.expanduser()))
    cwd = Path.cwd().resolve()
    real = path.resolve()
    if real == cwd or real in cwd.parents:
        raise OutputError(f"--out {out}: is the current directory or one of its parents; "
                          "name a new directory for the engine, e.g. engines/NAME")
    if real.parent == real:
        raise OutputError(f"--out {out}: is the file system's root; name a new directory")
    if path.exists():
        if not path.is_dir():
            raise OutputError(f"--out {out}: exists and is not a directory; name a new "
                              "directory for the engine")
        names = {p.name for p in path.iterdir()}
        if names:
            known = engine_entries(path)
            if known is None:
                raise OutputError(f"--out {out}: is a directory that holds files and no engine; "
                                  "charbuild replaces only an engine directory: name a new or "
                                  "empty directory")
            foreign = sorted(names - known)
            if foreign:
                raise OutputError(f"--out {out}: is an engine directory that also holds "
                                  f"{foreign[0]!r}, which is not part of the engine; move it "
                                  "out first, or name another directory")
    _, parent = missing_dirs(path)
    if not parent.is_dir():
        raise OutputError(f"--out {out}: cannot be created: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"--out {out}: cannot be created: {parent} is not writable")
    return path


def readable_by_all(root: Path) -> None:
    """Directories 0o777 and files 0o666 under `root`, less the umask (0755 and 0644 under the
    usual 022): an engine another user can read, such as the container's charengine user
    (uid 10001) from a read-only mount; mkdtemp makes 0700."""
    mask = current_umask()
    for d, _, files in os.walk(root):
        os.chmod(d, 0o777 & ~mask)
        for f in files:
            os.chmod(os.path.join(d, f), 0o666 & ~mask)


class Staging:
    """`with Staging(out) as tmp:` build into tmp, then `commit()`; leaving the block
    without a commit (an error, Ctrl-C, SIGTERM through SystemExit) removes tmp and the
    parent directories it created. One build writes an --out at a time (OutputLock: another
    is refused in one line), and what a build killed before it could clean up left beside
    --out (its staging directory) is removed when the next one begins."""

    def __init__(self, out: Path):
        self.out = check_out(out)
        self.tmp: Path | None = None
        self.created: list[Path] = []
        self.committed = False
        self.lock: OutputLock | None = None

    def __enter__(self) -> Path:
        try:
            self.created = make_dirs(missing_dirs(self.out)[0])
            try:
                self.lock = OutputLock(self.out)
            except Busy as e:
                self._clean()
                raise OutputError(f"--out {self.out}: another charbuild is writing it ({e}); "
                                  "wait for it to finish, or name another directory") from None
            for leftover in (f".{self.out.name}.building-*", f".{self.out.name}.replaced-*"):
                remove_stale(self.out.parent, leftover)
            self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.building-",
                                             dir=self.out.parent))
        except OSError as e:
            self._clean()
            raise OutputError(f"--out {self.out}: cannot be created ({e.strerror})") from None
        return self.tmp

    def commit(self) -> None:
        """Swap the built directory in: --out is checked again (it may have changed while
        the engine was built); an engine it held is removed only once the new one is there."""
        out = check_out(self.out)
        readable_by_all(self.tmp)
        old = None
        if out.exists():
            if any(out.iterdir()):
                old = Path(tempfile.mkdtemp(prefix=f".{out.name}.replaced-", dir=out.parent))
                os.rename(out, old / "engine")
            else:
                out.rmdir()
        os.rename(self.tmp, out)
        self.committed = True
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def _clean(self) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
        if self.lock is not None:
            self.lock.release()
            self.lock = None
        remove_dirs(self.created)

    def __exit__(self, *exc) -> None:
        if not self.committed:
            self._clean()
        elif self.lock is not None:
            self.lock.release()
            self.lock = None
