"""Compiled kernels as part of an engine: Triton's kernel cache pointed at a directory, and
a count of what gets compiled while it is active.

The production step compiles nothing but the Triton kernels in plugins/ and, where the
engine's GEMM plan or switches use it, QuACK's CuTe DSL GEMMs (the rest is eager torch ops
into cuBLASLt and cuDNN, replayed from CUDA graphs). charbuild warms every code path up on
the target GPU with both caches pointed into the engine, so the engine holds each Triton
kernel's cubin and launcher and each QuACK kernel's object file (QuACK keys them by a
fingerprint of its own sources, CUTLASS's and Python's versions, and the epilogue's source);
charrun points both at a copy of them, and a kernel that is not there is compiled and
counted (`compiled`, `quack_compiled`), never silently.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path


def _dynamo_graphs() -> int:
    """Graphs torch.compile has made in this process (0 if Dynamo was never imported)."""
    dynamo = sys.modules.get("torch._dynamo.utils")
    return int(dynamo.counters["stats"]["unique_graphs"]) if dynamo is not None else 0


def relocate(root: Path) -> None:
    """Point Triton's group files under `root` at the copies next to them. Triton records each
    compiled kernel's files by absolute path (`__grp__*.json`: {"child_paths": {name: path}})
    and treats a group whose paths are gone as a miss, so a cache moved from where it was
    built (the builder's directory) must be rewritten to where it now lies."""
    for grp in root.glob("*/__grp__*.json"):
        data = json.loads(grp.read_text())
        paths = data.get("child_paths") or {}
        data["child_paths"] = {name: str(root / Path(p).parent.name / Path(p).name)
                               for name, p in paths.items()}
        grp.write_text(json.dumps(data))


QUACK = "quack"  # QuACK's objects: the directory beside Triton's


class KernelCache:
    """While active, Triton reads and writes compiled kernels under `directory` and every
    compilation (a cache miss) and load (a hit) is recorded by kernel name; with `quack`,
    QuACK's cache is the directory beside it (`QUACK`), and its new object files are its
    compilations."""

    def __init__(self, directory: Path, quack: bool = False):
        self.directory = Path(directory)
        self.quack_directory = self.directory.parent / QUACK if quack else None
        self._quack_saved = None
        self._quack_before: set[Path] = set()
        self.compiled: list[str] = []
        self.loaded: list[str] = []
        self._saved = None
        self._graphs0 = 0
        self._tmp: tempfile.TemporaryDirectory | None = None

    @classmethod
    def copy_of(cls, source: Path | None, quack: bool = False) -> "KernelCache":
        """A cache over a private copy of `source` and, with `quack`, of QuACK's directory
        beside it (an engine's kernels stay untouched and checksummed even if something has
        to be compiled); empty without a source."""
        tmp = tempfile.TemporaryDirectory(prefix="charengine-kernels-")
        dst = Path(tmp.name) / "triton"
        if source is not None:
            shutil.copytree(source, dst)
            relocate(dst)
            if quack and (Path(source).parent / QUACK).is_dir():
                shutil.copytree(Path(source).parent / QUACK, dst.parent / QUACK)
        cache = cls(dst, quack)
        cache._tmp = tmp
        return cache

    @classmethod
    def empty(cls, quack: bool = False) -> "KernelCache":
        """A fresh, empty cache: every kernel is compiled."""
        return cls.copy_of(None, quack)

    def _quack_objects(self) -> set[Path]:
        return set(self.quack_directory.rglob("*.o")) if self.quack_directory else set()

    @property
    def quack_compiled(self) -> list[str]:
        """QuACK's objects compiled since activation (fingerprint/key.o)."""
        return sorted(str(p.relative_to(self.quack_directory))
                      for p in self._quack_objects() - self._quack_before)

    @property
    def compiles(self) -> int:
        """Kernels Triton and QuACK compiled plus graphs torch.compile made since
        activation."""
        return len(self.compiled) + len(self.quack_compiled) + _dynamo_graphs() - self._graphs0

    def _listener(self, *, src, cache_hit: bool, **_):
        fn = getattr(src, "fn", None)
        name = getattr(fn, "__name__", None) or getattr(src, "name", None) or str(src)[:60]
        (self.loaded if cache_hit else self.compiled).append(name)
        if self._saved and self._saved[1] is not None:
            self._saved[1](src=src, cache_hit=cache_hit, **_)

    def activate(self) -> "KernelCache":
        from triton import knobs

        self.directory.mkdir(parents=True, exist_ok=True)
        self._saved = (knobs.cache.dir, knobs.compilation.listener)
        knobs.cache.dir = str(self.directory)
        knobs.compilation.listener = self._listener
        self._graphs0 = _dynamo_graphs()
        if self.quack_directory is not None:
            import quack.cache

            self.quack_directory.mkdir(parents=True, exist_ok=True)
            self._quack_saved = (quack.cache.CACHE_DIR,)
            quack.cache.CACHE_DIR = str(self.quack_directory)
            self._quack_before = self._quack_objects()
        return self

    def deactivate(self) -> None:
        if self._saved is not None:
            from triton import knobs

            knobs.cache.dir, knobs.compilation.listener = self._saved
            self._saved = None
        if self.quack_directory is not None and self._quack_saved is not None:
            import quack.cache

            quack.cache.CACHE_DIR = self._quack_saved[0]
            self._quack_saved = None

    def close(self) -> None:
        self.deactivate()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "KernelCache":
        return self.activate()

    def __exit__(self, *exc) -> None:
        self.deactivate()
