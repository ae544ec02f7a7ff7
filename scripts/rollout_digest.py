"""Digests of the tiny presets' rollouts under every switch arm and numerics, for both
families: a refactor that must not change behaviour leaves every digest as it was.

- characters (`tiny`, `tiny-d64`, `tiny-10h`): every cumulative switch arm, every switch off
  alone, the epilogue and numerics variants at TP-1 in this process, and five arms at TP-3
  as real processes over gloo;
- livetalk (`tiny-livetalk`): the baseline, every cumulative switch arm, every switch off
  alone, every waterfall arm (scripts/bench_waterfall.py's), every numerics arm
  (scripts/numerics_compare.py's) and the benchmark arms, at TP-1 in this process; and the
  frames of a render through the engines `cpu-tiny-livetalk` (in this process) and
  `cpu-tiny-livetalk-x2` (the diffusion in a process of its own over gloo).

    python scripts/rollout_digest.py --out digests.json [--against before.json]

Each arm's rollout (random weights, seed 0; inputs seed 1, LiveTalk's chunks seed 2) is
hashed as its exact bytes (sha256 of the fp32 latents, or the rendered frames). --against
compares with an earlier run and exits 1 on any difference, naming the arms that changed.
The digests are the CPU's (its kernels round differently on AVX2, AVX-512 and AMX): compare
runs made on one machine."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from charengine.config import EngineConfig, Numerics, preset  # noqa: E402
from charengine.characters.config import Switches  # noqa: E402
from charengine.runtime.distributed import free_port  # noqa: E402
from rollout import rollout  # noqa: E402

STEPS = 45  # one reset (step 42), calibration and several ring wraps
TP = 3
CHUNKS = 14  # LiveTalk: the cache's filling chunks, calibration and four position resets
RENDER_S = 3.0  # seconds of speech a LiveTalk engine renders


def arms() -> dict[str, tuple[str, Switches, Numerics]]:
    """name -> (preset, switches, numerics): the baseline, every cumulative arm, every
    switch off alone, the epilogue switches on, and the numerics variants."""
    out = {"baseline": ("tiny", Switches.baseline(), Numerics())}
    for upto in Switches.ORDER:
        out[f"upto-{upto}"] = ("tiny", Switches.cumulative(upto), Numerics())
    for f in dataclasses.fields(Switches):
        sw = Switches()
        if getattr(sw, f.name):
            try:
                off = dataclasses.replace(sw, **{f.name: False})
                preset("tiny", switches=off)
            except ValueError:
                continue
            out[f"no-{f.name}"] = ("tiny", off, Numerics())
    out["gemm_residual"] = ("tiny", Switches(gemm_residual=True), Numerics())
    out["gemm_swiglu"] = ("tiny", Switches(gemm_swiglu=True), Numerics())
    out["epilogues"] = ("tiny", Switches(gemm_swiglu=True, gemm_residual=True), Numerics())
    fp32 = Numerics(dtype="float32", fp8_gemm=False, fp8_attention=False)
    out["fp32"] = ("tiny", Switches(fp8_kv=False), fp32)
    out["fp32-baseline"] = ("tiny", Switches.baseline(), fp32)
    out["bf16-cache"] = ("tiny", Switches(fp8_kv=False), Numerics(fp8_attention=False))
    out["no-fp8-gemm"] = ("tiny", Switches(), Numerics(fp8_gemm=False))
    out["no-fast-accum"] = ("tiny", Switches(), Numerics(fast_accum=False))
    out["d64"] = ("tiny-d64", Switches(), Numerics())
    return out


TP_ARMS = ("baseline", "upto-fused_gemm_allreduce", "epilogues", "fp32", "no-fp8-gemm")


def livetalk_arms() -> dict[str, EngineConfig]:
    """name -> the tiny-livetalk config of each LiveTalk arm (see the module's doc)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from charengine.livetalk.arms import NUMERICS, NUMERICS_REFERENCE, numerics_config
    from charengine.livetalk.spec import (ARMS as BENCH_ARMS, TINY, LiveTalkSwitches,
                                          arm_config, waterfall_arms, waterfall_config)

    base = EngineConfig(model=TINY, switches=LiveTalkSwitches(),
                        numerics=Numerics(dtype="bfloat16"))
    fp32 = Numerics(dtype="float32", fp8_gemm=False, fp8_attention=False)
    out = {"baseline": base.replace(switches=LiveTalkSwitches.baseline(), numerics=fp32)}
    for upto in LiveTalkSwitches.ORDER:  # fp32, the cache in fp32 (as the parity tests)
        sw = dataclasses.replace(LiveTalkSwitches.cumulative(upto), fp8_kv=False)
        out[f"upto-{upto}"] = base.replace(switches=sw, numerics=fp32)
    for name in LiveTalkSwitches.ORDER:  # where the others run without it
        try:
            out[f"no-{name}"] = base.replace(
                switches=dataclasses.replace(base.switches, **{name: False}))
        except ValueError:
            continue
    for arm in waterfall_arms():
        out[f"waterfall-{arm}"] = waterfall_config(base, arm)
    for arm in NUMERICS:
        if arm != NUMERICS_REFERENCE:
            out[f"numerics-{arm}"] = numerics_config(base, arm)
    for arm in BENCH_ARMS:
        out[f"bench-{arm}"] = arm_config(base, arm)
    return out


def livetalk_rollout(cfg: EngineConfig, chunks: int = CHUNKS) -> torch.Tensor:
    """Every chunk's latent of an eager CPU session of `cfg` (weights seed 0; reference and
    prompt seed 1, the chunks' noise and features seed 2)."""
    from charengine.assemble import rank_session
    from charengine.family import family
    from charengine.mapping import Mapping

    fam, spec = family("livetalk"), cfg.model
    full = fam.random_weights(spec, 0)
    tables = fam.bake_tables(cfg, full) if cfg.switches.baked_adaln else None
    s = rank_session(cfg, fam.rank_state(cfg, full), Mapping.single("cpu"), tables=tables)
    g = torch.Generator().manual_seed(1)
    shapes = fam.step_shapes(spec)
    with torch.inference_mode():
        s.start(torch.randn(spec.latent_channels, spec.latent_h, spec.latent_w, generator=g),
                torch.randn(spec.prompt_tokens, spec.text_dim, generator=g))
        g = torch.Generator().manual_seed(2)
        ins = [(torch.randn(shapes.noise_shape, generator=g),
                torch.randn(shapes.features, generator=g)) for _ in range(chunks)]
        return torch.stack([s.step(n, a).float() for n, a in ins])


def livetalk_renders() -> dict[str, str]:
    """Digests of the frames a render makes through the engines cpu-tiny-livetalk and
    cpu-tiny-livetalk-x2 (random weights, seed 0), the same speech and image."""
    from engines import build_target

    from charengine.runtime.distributed import open_worker
    from charengine.runtime.engine import Engine

    g = torch.Generator().manual_seed(3)
    speech = torch.randn(int(RENDER_S * 16000), generator=g) * 0.1
    out = {}
    with tempfile.TemporaryDirectory() as d:
        for target in ("cpu-tiny-livetalk", "cpu-tiny-livetalk-x2"):
            worker = open_worker(Engine.load(build_target(Path(d), target)))
            try:
                spec = worker.spec
                image = torch.rand(3, spec.out_h, spec.out_w, generator=g.manual_seed(4))
                frames = []
                worker.start(image, "")
                worker.run(speech, worker.family.steps_for(spec, speech.numel()),
                           lambda i, f: frames.append(f.clone()))
            finally:
                worker.close()
            out[f"livetalk/render/{target}"] = digest(torch.cat(frames))
    return out


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.float().contiguous().numpy().tobytes()).hexdigest()[:16]


def _tp_worker(rank, port, cfgs, out_path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=TP)
    try:
        got = {name: digest(rollout(cfg, STEPS, rank=rank))
               for name, cfg in cfgs.items()}
        if rank == 0:
            Path(out_path).write_text(json.dumps(got))
    finally:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--against", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    found = {}
    table = arms()
    for name, (p, sw, num) in table.items():
        found[f"tp1/{name}"] = digest(rollout(preset(p, switches=sw, numerics=num), STEPS))
    tp_cfgs = {}
    for name in TP_ARMS:
        _, sw, num = table[name]
        tp_cfgs[name] = preset("tiny-10h", switches=sw, numerics=num, tp=TP)
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "tp.json"
        mp.start_processes(_tp_worker, args=(free_port(), tp_cfgs, str(out)), nprocs=TP,
                           start_method="spawn")
        found.update({f"tp{TP}/{k}": v for k, v in json.loads(out.read_text()).items()})
    for name, cfg in livetalk_arms().items():
        found[f"livetalk/tp1/{name}"] = digest(livetalk_rollout(cfg))
    found.update(livetalk_renders())
    args.out.write_text(json.dumps(found, indent=1) + "\n")
    print(f"{len(found)} rollouts of {STEPS} steps digested -> {args.out}")
    if args.against:
        before = json.loads(args.against.read_text())
        changed = sorted(k for k in before if found.get(k) != before[k])
        missing = sorted(set(found) - set(before))
        for k in changed:
            print(f"changed: {k} {before[k]} -> {found.get(k)}")
        if missing:
            print(f"not in {args.against}: {', '.join(missing)}")
        print("bit-identical" if not changed else f"{len(changed)} rollouts differ")
        sys.exit(1 if changed else 0)


if __name__ == "__main__":
    main()
