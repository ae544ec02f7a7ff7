"""Outputs' directories and temporary siblings: the directories missing above an output,
made on request and removed again when it is not written (charbuild's engine directory,
charrun's video); the temporary files and directories an output is written in, held by
their live writer (a flock) so that the next run removes those a killed one left; the
one writer of an output (charbuild's --out); what an input that should be a file is when
it is not one; and the path options of charbuild and charrun, whose names the file system
must be able to take."""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

import click

NAME_MAX = 255  # bytes of one name, where the file system does not say (Linux's)
PATH_MAX = 4096  # bytes of a whole path, as the kernel takes it


class PathOption(click.Path):
    """A path option (a pathlib.Path) whose names the file system can take: one longer than
    its NAME_MAX, or a path longer than PATH_MAX, is a usage error in one line here rather
    than an OSError from whichever call first meets it."""

    def __init__(self):
        super().__init__(path_type=Path)

    def convert(self, value, param, ctx):
        path = super().convert(value, param, ctx)
        raw = os.fsencode(path)
        if len(raw) >= PATH_MAX:
            self.fail(f"{len(raw):,} bytes long, more than a path may be ({PATH_MAX - 1:,})",
                      param, ctx)
        most = name_max(Path(path))
        for name in Path(path).parts:
            if len(os.fsencode(name)) > most:
                self.fail(f"the name {name[:40]}... is {len(os.fsencode(name))} bytes long, "
                          f"more than the file system takes ({most})", param, ctx)
        return path


def name_max(path: Path) -> int:
    """The longest name the file system under `path` takes (its nearest existing
    directory's), NAME_MAX where it does not say."""
    parent = Path(path).absolute()
    while parent != parent.parent:
        try:
            if parent.is_dir():
                break
        except OSError:  # a name too long to look up, among others
            pass
        parent = parent.parent
    try:
        return os.pathconf(parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        return NAME_MAX


def current_umask() -> int:
    """The process's umask (read by setting it and putting it back: call it where no other
    thread is creating files)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def not_a_file(path: Path) -> str | None:
    """What a path given as an input file is, said for a one-line error, when it is not a
    regular file (None when it is): missing, a directory, or a device, pipe or socket (which
    could block or never end)."""
    path = Path(path)
    try:
        if path.is_file():
            return None
        if path.is_dir():
            return "is a directory, not a file"
        if path.exists():
            return "is not a regular file (a device, pipe or socket)"
    except OSError as e:  # a name too long, a loop of links, no permission to look
        return f"cannot be looked up ({e.strerror})"
    return "no such file"


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


def remove_stale(directory: Path, pattern: str) -> list[Path]:
    """Remove what matches glob `pattern` in `directory` (a temporary file or directory an
    output is written in) and is not held by a live writer (`Held`): what a run killed before
    it could clean up left behind. Returns what was removed."""
    removed = []
    for p in Path(directory).glob(pattern):
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # its writer is alive
            os.close(fd)
            continue
        try:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p)
        finally:
            os.close(fd)
    return removed


class Held:
    """An exclusive flock on a path (a temporary file or directory being written) for as
    long as this process holds it (release(), or the process's end, however it ends), which
    marks it as a live writer's to remove_stale."""

    def __init__(self, path: Path):
        self.fd: int | None = os.open(path, os.O_RDONLY)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class Busy(RuntimeError):
    """Another live process holds the lock (its pid in the message)."""


class OutputLock:
    """The one writer of an output: an exclusive flock on `.NAME.lock` beside it, taken at
    once or refused (Busy, naming the holder's pid). The kernel lets go of it however the
    process ends; the file is removed by release(), so a killed writer's is removed by the
    next writer to finish."""

    def __init__(self, out: Path):
        self.path = Path(out).parent / f".{Path(out).name}.lock"
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise Busy(f"pid {holder}") from None
            try:  # the file may have been removed by the writer before us after we opened it
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self.fd: int | None = fd

    def release(self) -> None:
        if self.fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = None
