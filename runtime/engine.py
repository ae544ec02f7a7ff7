"""Engine.load(dir): read an engine directory and check it against this machine before
anything heavy happens. Every problem is one EngineError line naming what to do."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from charengine.config import EngineConfig, config_from_dict
from charengine.engine_format import (ADALN, FORMAT_VERSION, MANIFEST, SIDE, rank_file, sha256,
                                      this_machine)
from charengine.target import Target


class EngineError(RuntimeError):
    pass


def _minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def check_machine(target: Target, built_with: dict, machine: dict) -> None:
    """Refuse an engine this machine cannot run: other device kind, too few GPUs, another GPU
    architecture, or another torch / CUDA than it was built with."""
    if target.device == "cuda":
        need = f"{target.gpus} CUDA GPU{'s' if target.gpus > 1 else ''} ({target.gpu}, {target.gpu_arch})"
        if machine["gpu_count"] == 0:
            raise EngineError(f"engine {target.name} needs {need}; this machine has no CUDA GPU")
        if machine["gpu_count"] < target.gpus:
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


@dataclass
class Engine:
    path: Path
    manifest: dict
    target: Target
    config: EngineConfig

    @classmethod
    def load(cls, path: str | Path, machine: dict | None = None) -> "Engine":
        path = Path(path)
        mpath = path / MANIFEST
        if not mpath.is_file():
            raise EngineError(f"{path}: not an engine directory (no {MANIFEST}); build one with "
                              "charbuild")
        try:
            manifest = json.loads(mpath.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise EngineError(f"{mpath}: unreadable manifest ({e}); rebuild the engine") from None
        version = manifest.get("format_version")
        if version != FORMAT_VERSION:
            raise EngineError(f"{path}: engine format {version}, this charrun reads format "
                              f"{FORMAT_VERSION}; rebuild it with this version's charbuild")
        try:
            target = Target.from_dict(manifest["target"])
            config = config_from_dict(manifest["config"])
        except (KeyError, TypeError, ValueError) as e:
            raise EngineError(f"{mpath}: invalid target or config ({e}); rebuild the engine") from None
        check_machine(target, manifest.get("built_with", {}), machine or this_machine())
        files = manifest.get("files", {})
        expected = {ADALN, SIDE, *(rank_file(r) for r in range(config.tp))}
        for name in sorted(expected | set(files)):
            f = path / name
            if not f.is_file():
                raise EngineError(f"{path}: engine file {name} is missing; rebuild the engine")
            if name not in files:
                raise EngineError(f"{path}: the manifest lists no checksum for {name}; rebuild")
            if sha256(f) != files[name]:
                raise EngineError(f"{path}: checksum mismatch in {name}: the file is damaged or "
                                  "was changed after the build; rebuild the engine")
        return cls(path, manifest, target, config)

    def rank_state(self, rank: int) -> dict[str, torch.Tensor]:
        return load_file(str(self.path / rank_file(rank)))

    def adaln_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        t = load_file(str(self.path / ADALN))
        return t["adaln_table"], t["final_table"]

    def side_state(self) -> dict[str, torch.Tensor]:
        return load_file(str(self.path / SIDE))
