"""The output projection with its all-reduce, at a preset's rank-slice shape: the GEMM alone
(`_scaled_mm`, the Triton GEMM), the GEMM then NCCL's all-reduce, and the fused GEMM +
symmetric-memory exchange (plugins/gemm_allreduce.py). Each candidate runs as one CUDA
graph of `--calls` calls over weights rotated past L2.

    python scripts/bench_gemm_allreduce.py --tp 3             # one GPU: world size one, and
                                                              # three ranks' buffers on it
    python scripts/bench_gemm_allreduce.py --tp 2 --world 2   # two GPUs, real processes

Writes docs/results/gemm_allreduce_<preset>_tp<tp>_w<world>_<gpu>.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kernel_timing import graph_time_us
from charengine import fp8
from charengine.characters.spec import RankShape
from charengine.config import preset
from charengine.engine_format import this_machine
from charengine.plugins import gemm_allreduce as gar
from charengine.plugins.fp8_gemm import triton_scaled_mm
from charengine.provenance import provenance


def operands(m, k, n, copies, device):
    g = torch.Generator(device=device).manual_seed(0)
    aq, a_s = fp8.quantize_rows(torch.randn(m, k, device=device, generator=g))
    ws = []
    for _ in range(copies):
        wq, s = fp8.quantize_rows(torch.randn(n, k, device=device, generator=g))
        ws.append((wq, s[:, 0].contiguous()))
    return aq, a_s, ws


def one_gpu(args, m, k, n) -> dict:
    dev = torch.device("cuda")
    aq, a_s, ws = operands(m, k, n, args.copies, dev)
    (x1,) = gar.Exchange.local(1, m, n, dev)
    xs = gar.Exchange.local(args.tp, m, n, dev)

    def w(i):
        return ws[i % len(ws)]

    def fused_emulated(i):
        for x in xs:  # every rank's push lands on this one GPU
            gar.gemm_push(x, aq, a_s, *w(i))
        gar.reduce(xs[0], torch.bfloat16)
        for x in xs[1:]:
            x.epoch.add_(1)

    return {
        "scaled_mm_us": graph_time_us(lambda i: fp8.scaled_mm(aq, a_s, *w(i), torch.bfloat16),
                                      args.calls, args.reps),
        "triton_gemm_us": graph_time_us(lambda i: triton_scaled_mm(aq, a_s, *w(i),
                                                                   torch.bfloat16),
                                        args.calls, args.reps),
        "fused_world1_us": graph_time_us(
            lambda i: (gar.gemm_push(x1, aq, a_s, *w(i)), gar.reduce(x1, torch.bfloat16)),
            args.calls, args.reps),
        f"fused_{args.tp}_ranks_on_one_gpu_us": graph_time_us(fused_emulated, args.calls,
                                                              args.reps),
    }


def _rank(rank, world, port, args, m, k, n, out):
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=dev)
    aq, a_s, ws = operands(m, k, n, args.copies, dev)
    op = gar.SymmetricGemmAllReduce(gar.Exchange.symmetric(dist.group.WORLD, m, n, dev))

    def nccl(t):
        dist.all_reduce(t)
        return t

    def w(i):
        return ws[i % len(ws)]

    res = {
        "scaled_mm_us": graph_time_us(lambda i: fp8.scaled_mm(aq, a_s, *w(i), torch.bfloat16),
                                      args.calls, args.reps),
        "scaled_mm_then_nccl_us": graph_time_us(
            lambda i: gar.reference(aq, a_s, *w(i), torch.bfloat16, False, nccl),
            args.calls, args.reps),
        "fused_us": graph_time_us(
            lambda i: op(aq, a_s, *w(i), torch.bfloat16, False, nccl), args.calls, args.reps),
    }
    if rank == 0:
        Path(out).write_text(json.dumps(res))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="characters-57b")
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--world", type=int, default=1, help="GPUs (processes) in the exchange")
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--copies", type=int, default=8, help="weight copies rotated past L2")
    ap.add_argument("--gpu-tag", default="h200")
    ap.add_argument("--out", type=Path, default=Path("docs/results"))
    args = ap.parse_args()
    spec = preset(args.preset).model
    m, n = spec.tokens_per_frame, spec.dim
    k = RankShape.of(spec, args.tp, 0).out_proj_cols(spec)
    if args.world == 1:
        res = one_gpu(args, m, k, n)
    else:
        import tempfile

        import torch.multiprocessing as mp

        from charengine.runtime.distributed import free_port

        out = tempfile.mktemp(suffix=".json")
        mp.start_processes(_rank, args=(args.world, free_port(), args, m, k, n, out),
                           nprocs=args.world, join=True, start_method="spawn")
        res = json.loads(Path(out).read_text())
    result = {"preset": args.preset, "tp": args.tp, "world": args.world,
              "shape_mkn": [m, k, n], "us_per_call": res, "calls": args.calls,
              "reps": args.reps, "machine": this_machine(), **provenance()}
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"gemm_allreduce_{args.preset}_tp{args.tp}_w{args.world}_{args.gpu_tag}.json"
    (args.out / name).write_text(json.dumps(result, indent=1) + "\n")
    print(f"M, K, N = {m}, {k}, {n}, world {args.world}: " +
          ", ".join(f"{k_} {v:.1f}" for k_, v in res.items()))


if __name__ == "__main__":
    main()
