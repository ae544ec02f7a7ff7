"""Digests of the tiny presets' rollouts under every switch arm and numerics, TP-1 in this
process and TP-3 as real processes over gloo: a refactor that must not change behaviour
leaves every digest as it was.

    python scripts/rollout_digest.py --out digests.json [--against before.json]

Each arm's rollout (random weights, seed 0; inputs seed 1) is hashed as its exact bytes
(sha256 of the fp32 latents). --against compares with an earlier run and exits 1 on any
difference, naming the arms that changed."""

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

from charengine.config import Numerics, Switches, preset  # noqa: E402
from charengine.runtime.distributed import free_port  # noqa: E402
from rollout import rollout  # noqa: E402

STEPS = 45  # one reset (step 42), calibration and several ring wraps
TP = 3


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
