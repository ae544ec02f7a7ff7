"""BuildConfig: every input of one engine build (what charbuild's flags give), and the package
data a build reads: the target files a target name is looked up in and the trained
checkpoints shipped with the package (found through the installed package, a wheel or a
source checkout alike)."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from charengine.paths import not_a_file
from charengine.target import Target

PACKAGE_DIR = Path(str(resources.files("charengine")))
TARGETS_DIR = PACKAGE_DIR / "targets"
CHECKPOINTS_DIR = PACKAGE_DIR / "checkpoints"


def find_target(name: str) -> Target:
    """A target by name (a file in charengine/targets/) or by the path of a target .toml;
    ValueError, one line, for one that is unknown or does not read."""
    path = Path(name)
    if not path.suffix:
        path = TARGETS_DIR / f"{name}.toml"
    if not_a_file(path) is not None:
        known = ", ".join(sorted(p.stem for p in TARGETS_DIR.glob("*.toml")))
        raise ValueError(f"unknown target {name!r}; known targets: {known}")
    try:
        return Target.from_toml(path)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: {e}") from None


@dataclass(frozen=True)
class BuildConfig:
    """One build. `target`: a Target, or a name or path that find_target reads. `out`: the
    engine directory, replaced only where it is absent, empty or an engine directory
    (builder/output.py). Exactly one of `weights` (a safetensors checkpoint) and `seed`
    (random weights) is given. `preset_name` overrides the target's preset. `ranks` builds a
    part of the layout (a rank slice to benchmark on fewer GPUs; charrun refuses to serve
    it), None every rank. `kernels=False` leaves a GPU target's kernels to be compiled when
    charrun starts. `random_side_networks` lets a checkpoint without side networks build
    with random ones (seeded by `seed` or 0). `side_files` names the side networks' own
    files for a family whose checkpoint holds only the DiT (LiveTalk: "vae" a Wan 2.1 VAE
    .pth, "wav2vec" a wav2vec2 directory, "prompt_features" a safetensors of umT5 features
    or "text_encoder" a umT5 directory with "prompt" the text to encode). `export_onnx` also
    writes the decoder and the audio encoder as ONNX into the engine (builder/onnx_export.py).
    `lora`: a LoRA file merged into the weights before they are quantized (charengine/lora.py)."""

    target: Target | str
    out: Path
    weights: Path | None = None
    seed: int | None = None
    preset_name: str | None = None
    ranks: tuple[int, ...] | None = None
    kernels: bool = True
    random_side_networks: bool = False
    side_files: tuple[tuple[str, str], ...] = ()  # (name, path or text) pairs, given ones only
    export_onnx: bool = False
    lora: Path | None = None

    def __post_init__(self):
        object.__setattr__(self, "out", Path(self.out))
        if self.lora is not None:
            object.__setattr__(self, "lora", Path(self.lora))
        if self.weights is not None:
            object.__setattr__(self, "weights", Path(self.weights))
        object.__setattr__(self, "side_files", tuple((k, str(v)) for k, v in
                                                     dict(self.side_files).items()
                                                     if v not in (None, "")))
        if self.ranks is not None:
            object.__setattr__(self, "ranks", tuple(self.ranks))
        if (self.weights is None) == (self.seed is None):
            raise ValueError("give either a checkpoint or a seed for random weights")

    def load_target(self) -> Target:
        return self.target if isinstance(self.target, Target) else find_target(self.target)
