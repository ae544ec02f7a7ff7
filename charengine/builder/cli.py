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
from charengine.family import all_presets

from .build_config import CHECKPOINTS_DIR, BuildConfig, find_target

# Trained checkpoints shipped with the package: a preset's weights when none are given.
EMBEDDED_CHECKPOINTS = {"tiny": CHECKPOINTS_DIR / "tiny.safetensors"}
# Presets an engine may be built for with random weights without asking (test sizes).
EMBEDDED_RANDOM_OK = ("tiny-10h", "tiny-livetalk")


def config_of(target_name, out, weights, random_weights, seed, preset_name, ranks, no_kernels,
              random_side_networks, side_files=(), export_onnx=False) -> BuildConfig:
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
        embedded = EMBEDDED_CHECKPOINTS.get(preset)
        if embedded is not None and embedded.is_file():
            weights = embedded
            click.echo(f"charbuild: no --weights: the trained {preset} checkpoint, {embedded}",
                       err=True)
        elif preset in EMBEDDED_RANDOM_OK:
            click.echo(f"charbuild: no --weights: random weights (seed {seed})", err=True)
        else:
            raise click.UsageError(f"{target.name} needs --weights CKPT (or --random-weights "
                                   "for benchmarks)")
    return BuildConfig(target, out, weights=weights, seed=None if weights else seed,
                       preset_name=preset_name, ranks=ranks, kernels=not no_kernels,
                       random_side_networks=random_side_networks, side_files=side_files,
                       export_onnx=export_onnx)


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
@click.option("--out", type=click.Path(path_type=Path), required=True,
              help="Engine directory to write: a new or empty directory, or an engine "
                   "directory, which is replaced once the new engine is complete.")
@click.option("--weights", type=click.Path(path_type=Path),
              help="Full-precision safetensors checkpoint of the model (its family's layout: "
                   "charengine/characters/weights.py, charengine/livetalk/weights.py).")
@click.option("--random-weights", is_flag=True, help="Random weights of the exact shapes.")
@click.option("--random-side-networks", is_flag=True,
              help="Build from a checkpoint that holds no side networks, with random ones "
                   "(the frames are then not the model's; the summaries say so).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for --random-weights.")
@click.option("--preset", "preset_name", type=click.Choice(sorted(all_presets())),
              help="Model preset, overriding the target's.")
@click.option("--ranks", help="Build only these TP ranks (comma-separated), e.g. one rank's "
                              "slice to benchmark on one GPU; charrun does not serve it.")
@click.option("--vae", type=click.Path(path_type=Path),
              help="LiveTalk: the Wan 2.1 VAE (Wan2.1_VAE.pth; read with weights_only).")
@click.option("--wav2vec", type=click.Path(path_type=Path),
              help="LiveTalk: a local wav2vec2-base-960h directory (transformers).")
@click.option("--prompt-features", type=click.Path(path_type=Path),
              help="LiveTalk: the prompt as umT5-XXL features [512, 4096] in a safetensors file.")
@click.option("--text-encoder", type=click.Path(path_type=Path),
              help="LiveTalk: a local umT5 encoder directory (transformers) to encode --prompt.")
@click.option("--prompt", default="", help="LiveTalk: the prompt --text-encoder encodes.")
@click.option("--no-kernels", is_flag=True,
              help="Do not compile a GPU target's kernels into the engine (charrun compiles "
                   "them at every start); lets a GPU engine be built without its GPU.")
@click.option("--export-onnx", is_flag=True,
              help="Also write the decoder and the audio encoder as ONNX (opset 18, fixed "
                   "shapes) into the engine's onnx/ directory, each checked against torch "
                   "through onnxruntime (pip install 'charengine[onnx]'), for runtimes such as "
                   "TensorRT; charrun does not read them.")
def main(target_name, out, weights, random_weights, seed, preset_name, ranks, no_kernels,
         random_side_networks, vae, wav2vec, prompt_features, text_encoder, prompt, export_onnx):
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

    side_files = {"vae": vae, "wav2vec": wav2vec, "prompt_features": prompt_features,
                  "text_encoder": text_encoder, "prompt": prompt}
    config = config_of(target_name, out, weights, random_weights, seed, preset_name, ranks,
                       no_kernels, random_side_networks, side_files, export_onnx)
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
