"""charbuild: build an engine directory for a target."""

from __future__ import annotations

import errno
import os
import re
import signal
import sys
from pathlib import Path

import click

from charengine.checkpoint import CheckpointError
from charengine.family import FAMILIES, all_presets, family
from charengine.paths import PathOption

from .build_config import CHECKPOINTS_DIR, BuildConfig, find_target


def families():
    return [family(name) for name in FAMILIES]


def embedded_checkpoint(preset: str) -> Path | None:
    """The trained checkpoint shipped with the package for `preset` (its family's
    declaration), built from when no weights are given."""
    name = next((f.embedded_checkpoints[preset] for f in families()
                 if preset in f.embedded_checkpoints), None)
    return None if name is None else CHECKPOINTS_DIR / name


def random_ok(preset: str) -> bool:
    """Whether `preset` builds with random weights without asking (a family's test size)."""
    return any(preset in f.random_ok for f in families())


def build_inputs() -> dict:
    """Every family's build inputs by name, each flag with the family that takes it."""
    inputs = {}
    for f in families():
        for inp in f.build_inputs:
            inputs.setdefault(inp.name, (inp, []))[1].append(f.name)
    return inputs


def family_inputs(command):
    """`command` with one option per family build input (a path or a text), its help line
    naming the families that take it."""
    for inp, names in reversed(list(build_inputs().values())):
        kind = {"type": PathOption()} if inp.path else {"default": ""}
        command = click.option(inp.flag, inp.name, help=f"{', '.join(names)}: {inp.help}",
                               **kind)(command)
    return command


def config_of(target_name, out, weights, random_weights, seed, preset_name, ranks, no_kernels,
              random_side_networks, side_files=(), export_onnx=False,
              lora=None) -> BuildConfig:
    """The BuildConfig charbuild's flags give: without --weights or --random-weights, the
    preset's embedded checkpoint (or random weights for a test-size preset)."""
    if ranks is not None:
        try:
            ranks = [int(r) for r in ranks.split(",")]
        except ValueError:
            raise click.UsageError(f"--ranks {ranks!r}: give rank numbers like 0 or 0,2") from None
    if weights and random_weights:
        raise click.UsageError("give one of --weights CKPT and --random-weights, not both")
    try:
        target = find_target(target_name)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    preset = preset_name or target.preset
    if not weights and not random_weights:
        embedded = embedded_checkpoint(preset)
        if embedded is not None and embedded.is_file():
            weights = embedded
            click.echo(f"charbuild: no --weights: the trained {preset} checkpoint, {embedded}",
                       err=True)
        elif random_ok(preset):
            click.echo(f"charbuild: no --weights: random weights (seed {seed})", err=True)
        else:
            raise click.UsageError(f"{target.name} needs --weights CKPT (or --random-weights "
                                   "for benchmarks)")
    return BuildConfig(target, out, weights=weights, seed=None if weights else seed,
                       preset_name=preset_name, ranks=ranks, kernels=not no_kernels,
                       random_side_networks=random_side_networks, side_files=side_files,
                       export_onnx=export_onnx, lora=lora)


# errno of a write that found no room: a full disk, a file-size limit, a full quota
NO_ROOM = {errno.ENOSPC: "no space left on the device", errno.EFBIG: "a file-size limit",
           errno.EDQUOT: "the disk quota is full"}


def write_failure(e: BaseException) -> str | None:
    """What a failed write of the engine ran into (an OSError, or safetensors' error carrying
    its OS error), or None for anything else."""
    code = e.errno if isinstance(e, OSError) else None
    if code is None:
        found = re.search(r"\(os error (\d+)\)", str(e))
        code = int(found.group(1)) if found and type(e).__name__ == "SafetensorError" else None
    if code in NO_ROOM:
        return f"{NO_ROOM[code]}: {os.strerror(code)}"
    return None


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--target", "target_name", required=True,
              help="Target name (a file in charengine/targets/) or a path to a target .toml.")
@click.option("--out", type=PathOption(), required=True,
              help="Engine directory to write: a new or empty directory, or an engine "
                   "directory, which is replaced once the new engine is complete.")
@click.option("--weights", type=PathOption(),
              help="Full-precision safetensors checkpoint of the model (its family's layout: "
                   "charengine/characters/weights.py, charengine/livetalk/weights.py): one "
                   "file, or shards by their *.safetensors.index.json (or its directory).")
@click.option("--random-weights", is_flag=True, help="Random weights of the exact shapes.")
@click.option("--lora", type=PathOption(),
              help="A LoRA (safetensors, PEFT's or kohya's layout, its rank and alpha from the "
                   "file) merged into the weights before they are quantized.")
@click.option("--random-side-networks", is_flag=True,
              help="Build from a checkpoint that holds no side networks, with random ones "
                   "(the frames are then not the model's; the summaries say so).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for --random-weights.")
@click.option("--preset", "preset_name", type=click.Choice(sorted(all_presets())),
              help="Model preset, overriding the target's.")
@click.option("--ranks", help="Build only these TP ranks (comma-separated), e.g. one rank's "
                              "slice to benchmark on one GPU; charrun does not serve it.")
@family_inputs
@click.option("--no-kernels", is_flag=True,
              help="Do not compile a GPU target's kernels into the engine (charrun compiles "
                   "them at every start); lets a GPU engine be built without its GPU.")
@click.option("--export-onnx", is_flag=True,
              help="Also write the decoder and the audio encoder as ONNX (opset 18, fixed "
                   "shapes) into the engine's onnx/ directory, each checked against torch "
                   "through onnxruntime (pip install 'charengine[onnx]'), for runtimes such as "
                   "TensorRT; charrun does not read them.")
def main(target_name, out, weights, random_weights, seed, preset_name, ranks, no_kernels,
         random_side_networks, export_onnx, lora, **side_files):
    """Bake a per-rank engine: FP8 weights and scales, AdaLN tables for the fixed schedule,
    side networks, a GPU target's compiled kernels (built on that GPU), and a manifest with
    checksums that charrun checks before loading."""
    from .build import build

    # SIGTERM (docker stop, timeout) and SIGHUP (a closed terminal) unwind like Ctrl-C: the
    # staging directory is removed
    stopped_by = []

    def on_signal(signum, _frame):
        stopped_by.append(signum)
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)

    config = config_of(target_name, out, weights, random_weights, seed, preset_name, ranks,
                       no_kernels, random_side_networks, side_files, export_onnx, lora)
    try:
        m = build(config, log=lambda s: click.echo(s, err=True))
    except (CheckpointError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    except Exception as e:  # noqa: BLE001 - a write that failed: one line, or re-raised
        why = write_failure(e)
        if why is None:
            raise
        raise click.ClickException(f"the engine could not be written ({why}): free space "
                                   f"where --out is, or lift the file-size limit, and build "
                                   f"again; {out} is as it was") from None
    except KeyboardInterrupt:
        sig = stopped_by[0] if stopped_by else signal.SIGINT
        click.echo(f"charbuild: stopped by {signal.Signals(sig).name}; {out} is as it was",
                   err=True)
        sys.exit(128 + sig)
    if m["side_networks"] != "checkpoint":
        click.echo(f"charbuild: the side networks (audio encoder, decoder, image and text "
                   f"encoders) are {m['side_networks']}: the frames are not a trained "
                   "model's", err=True)
    click.echo(f"built {config.load_target().name} ({m['config']['model']['name']}, TP-{m['tp']}) -> {out}")


if __name__ == "__main__":
    sys.exit(main())
