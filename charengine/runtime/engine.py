"""Engine.load(dir): read an engine directory and check it against this machine before
anything heavy happens. Every problem is one EngineError line naming what to do."""

from __future__ import annotations

import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from charengine.config import EngineConfig, config_from_dict
from charengine.engine_format import (ADALN, FORMAT_VERSION, MANIFEST, ONNX, SIDE, checksums,
                                      rank_file, this_machine)
from charengine.kernel_cache import KernelCache
from charengine.target import Target


class EngineError(RuntimeError):
    pass


def _minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def check_machine(target: Target, built_with: dict, machine: dict, gpus: int | None = None,
                  kernels: bool = False) -> None:
    """Refuse an engine this machine cannot run: other device kind, too few GPUs (`gpus`: what
    the ranks being loaded need, default the whole layout), another GPU architecture, another
    torch / CUDA than it was built with, or, for compiled kernels, another Triton."""
    if target.device == "cuda":
        gpus = target.gpus if gpus is None else gpus
        need = f"{gpus} CUDA GPU{'s' if gpus > 1 else ''} ({target.gpu}, {target.gpu_arch})"
        if machine["gpu_count"] == 0:
            raise EngineError(f"engine {target.name} needs {need}; this machine has no CUDA GPU")
        if machine["gpu_count"] < gpus:
            raise EngineError(f"engine {target.name} needs {need} for TP-{target.tp}; this "
                              f"machine has {machine['gpu_count']}")
        if machine["gpu_arch"] != target.gpu_arch:
            raise EngineError(f"engine {target.name} was built for {target.gpu_arch}; this "
                              f"machine's GPU is {machine['gpu_name']} ({machine['gpu_arch']})")
    built, here = _minor(built_with.get("torch") or ""), _minor(machine.get("torch") or "")
    if built != here:
        raise EngineError(f"engine {target.name} was built with torch {built_with.get('torch')}; "
                          f"this machine has torch {machine.get('torch')}: rebuild it here with "
                          "charbuild")
    if target.device == "cuda" and built_with.get("cuda") != machine.get("cuda"):
        raise EngineError(f"engine {target.name} was built with CUDA {built_with.get('cuda')}; "
                          f"this machine has CUDA {machine.get('cuda')}: rebuild it here with "
                          "charbuild")
    if kernels and built_with.get("triton") != machine.get("triton"):
        raise EngineError(f"engine {target.name}'s kernels were compiled with Triton "
                          f"{built_with.get('triton')}; this machine has Triton "
                          f"{machine.get('triton')}: rebuild it here with charbuild")


def check_quack(target: Target, need: dict | None) -> None:
    """Refuse an engine whose GEMMs run on QuACK (manifest kernels.quack) where quack-kernels
    is missing or another version: its compiled objects are keyed by QuACK's sources."""
    if not need:
        return
    from importlib.metadata import PackageNotFoundError, version

    try:
        here = version("quack-kernels")
    except PackageNotFoundError:
        here = None
    if here != need.get("version"):
        has = f"quack-kernels {here}" if here else "no quack-kernels"
        raise EngineError(f"engine {target.name} runs its GEMMs on QuACK (quack-kernels "
                          f"{need.get('version')}); this machine has {has}: install that "
                          "version, or rebuild the engine here with charbuild")


# The manifest's top-level fields and the JSON types they must have.
MANIFEST_FIELDS = {"format_version": int, "target": dict, "config": dict, "tp": int,
                   "ranks": list, "kernels": dict, "files": dict}


def check_manifest(mpath: Path, manifest) -> None:
    """A manifest that is JSON but not an engine's: one EngineError line naming the field."""
    def bad(what: str):
        return EngineError(f"{mpath}: {what}; the manifest is damaged or was not written by "
                           "charbuild: rebuild the engine")

    if not isinstance(manifest, dict):
        raise bad(f"expected a JSON object, found {type(manifest).__name__}")
    for name, kind in MANIFEST_FIELDS.items():
        if name not in manifest:
            raise bad(f"no field {name!r}")
        v = manifest[name]
        if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
            raise bad(f"field {name!r} is {type(v).__name__}, expected {kind.__name__}")
    if not all(isinstance(r, int) and not isinstance(r, bool) for r in manifest["ranks"]):
        raise bad("field 'ranks' holds something other than rank numbers")
    for name, entry in manifest["files"].items():
        if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int)
                and isinstance(entry.get("sha256"), list)):
            raise bad(f"files[{name!r}] is not {{bytes, sha256}}")
        if name.startswith("/") or ".." in Path(name).parts:
            raise bad(f"files[{name!r}] points outside the engine directory")
    if not isinstance(manifest.get("built_with", {}), dict):
        raise bad("field 'built_with' is not an object")


def verify(path: Path, names: list[str], files: dict) -> None:
    sums = checksums(path, names)
    for name in names:
        if sums[name] != files[name]:
            raise EngineError(f"{path}: checksum mismatch in {name}: the file is damaged or "
                              "was changed after the build; rebuild the engine")


def _check_readable(engine: Path, f: Path) -> None:
    """Refuse, in one line, an engine file (or directory) this process may not read: say
    which, as whom, and what to do (charbuild writes an engine readable by all, so that a
    container running as another user can read it: runtime/engine.py's callers mount it)."""
    want = os.R_OK | (os.X_OK if f.is_dir() else 0)
    if os.access(f, want):
        return
    what = "the engine directory" if f == engine else f"engine file {f.relative_to(engine)}"
    raise EngineError(f"{engine}: cannot read {what} (permission denied for uid {os.getuid()}); "
                      f"make the engine readable (chmod -R a+rX {engine}) or run as its owner")


@dataclass
class Engine:
    path: Path
    manifest: dict
    target: Target
    config: EngineConfig

    pending: Future | None = field(default=None, repr=False)

    @classmethod
    def load(cls, path: str | Path, machine: dict | None = None,
             ranks: list[int] | None = None, verify_in_background: bool = False) -> "Engine":
        """Read and check an engine. `ranks`: the TP ranks this process loads (a rank
        process: its own; a benchmark: one rank's slice); by default the whole layout is
        served, which a partial build cannot do, and this process loads TP-1's rank, while
        a TP layout's rank processes load (and verify) their own. Checksums of what this
        process reads are verified before returning, or with verify_in_background while the
        weights load (the disk is read once for both); then `verified()` waits for them and
        raises their error."""
        path = Path(path)
        mpath = path / MANIFEST
        if path.is_dir():
            _check_readable(path, path)
        if not mpath.is_file():
            raise EngineError(f"{path}: not an engine directory (no {MANIFEST}); build one with "
                              "charbuild")
        _check_readable(path, mpath)
        try:
            manifest = json.loads(mpath.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise EngineError(f"{mpath}: unreadable manifest ({e}); rebuild the engine") from None
        version = manifest.get("format_version") if isinstance(manifest, dict) else None
        if isinstance(manifest, dict) and isinstance(version, int) and \
                not isinstance(version, bool) and version != FORMAT_VERSION:
            raise EngineError(f"{path}: engine format {version}, this charrun reads format "
                              f"{FORMAT_VERSION}; rebuild it with this version's charbuild")
        check_manifest(mpath, manifest)
        try:
            target = Target.from_dict(manifest["target"])
            config = config_from_dict(manifest["config"])
        except (KeyError, TypeError, ValueError) as e:
            raise EngineError(f"{mpath}: invalid target or config ({e}); rebuild the "
                              "engine") from None
        built = manifest["ranks"]
        kernels = manifest["kernels"]
        want = list(range(config.tp)) if ranks is None else sorted(set(ranks))
        missing = sorted(set(want) - set(built))
        if missing:
            raise EngineError(f"{path}: built for TP rank{'s' if len(built) > 1 else ''} "
                              f"{', '.join(map(str, built))} only (charbuild --ranks); "
                              f"{'a session' if ranks is None else 'this run'} needs rank "
                              f"{', '.join(map(str, missing))}: build the whole engine")
        gpus = None if ranks is None else len(want)
        check_machine(target, manifest.get("built_with", {}), machine or this_machine(), gpus,
                      kernels=bool(kernels.get("compiled")))
        check_quack(target, kernels.get("quack"))
        # what charrun reads: the ONNX graphs of --export-onnx are for other runtimes
        files = {n: e for n, e in manifest.get("files", {}).items()
                 if not n.startswith(f"{ONNX}/")}
        expected = {ADALN, SIDE, *(rank_file(r) for r in built)}
        for name in sorted(expected | set(files)):
            f = path / name
            if not f.is_file():
                raise EngineError(f"{path}: engine file {name} is missing; rebuild the engine")
            if name not in files:
                raise EngineError(f"{path}: the manifest lists no checksum for {name}; rebuild")
            _check_readable(path, f)
        loaded = {rank_file(r) for r in (want if ranks is not None or config.tp == 1 else [])}
        names = [n for n in sorted(files) if not n.startswith("rank") or n in loaded]
        if not verify_in_background:
            verify(path, names, files)
            return cls(path, manifest, target, config)
        pool = ThreadPoolExecutor(1, thread_name_prefix="engine-verify")
        pending = pool.submit(verify, path, names, files)
        pool.shutdown(wait=False)
        return cls(path, manifest, target, config, pending)

    def verified(self) -> None:
        """Wait for background checksum verification; raise its EngineError."""
        if self.pending is not None:
            self.pending.result()

    @contextmanager
    def verifying(self):
        """Reading the engine's files while their checksums are verified: on leaving, wait
        for the verification; a read that failed on a damaged file is reported as the
        checksum mismatch it is."""
        try:
            yield
        except Exception:
            self.verified()
            raise
        self.verified()

    def kernel_cache(self, use_compiled: bool = True) -> KernelCache:
        """Triton's cache (and QuACK's, where the engine runs it) over a copy of the engine's
        compiled kernels (empty for an engine built without them, or without use_compiled:
        then every kernel is compiled, and counted, at start)."""
        kernels = self.manifest["kernels"]
        d, quack = kernels.get("dir") if use_compiled else None, bool(kernels.get("quack"))
        return KernelCache.copy_of(self.path / d, quack) if d else KernelCache.empty(quack)

    def gemm_plan(self, rank: int) -> dict[str, str]:
        """The per-shape GEMM choice charbuild measured for `rank` ({} if none was)."""
        return dict(self.manifest["kernels"].get("gemm_plan", {}).get(str(rank), {}))

    def rank_state(self, rank: int, device="cpu") -> dict[str, torch.Tensor]:
        return load_file(str(self.path / rank_file(rank)), device=str(device))

    def tables(self, device="cpu") -> dict[str, torch.Tensor]:
        """The tables the family baked for the fixed schedule (the AdaLN modulations)."""
        return load_file(str(self.path / ADALN), device=str(device))

    def side_state(self, device="cpu") -> dict[str, torch.Tensor]:
        """The side networks' tensors, read straight onto `device`."""
        return load_file(str(self.path / SIDE), device=str(device))
