"""How far FP8 quantization moves a block linear's output at a preset's rank-slice shapes:
random normal activations [M = tokens per frame, K] and weights [N, K], the product of their
per-token / per-channel e4m3 quantizations (exact products, fp32 sums) against the fp32 product
of the originals, as relative L2; and the bf16 rounding of the output, for scale. The
accumulation's own error (promoted or not) needs the GPU: tests/test_kernels.py and
`bench_kernels.py --only gemm` measure it.

    python scripts/fp8_gemm_error.py --preset characters-57b --tp 3
"""

from __future__ import annotations

import argparse
import json

import torch

from charengine import fp8
from charengine.characters.spec import RankShape
from charengine.config import preset


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).norm() / ref.norm())


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="characters-57b")
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--n", type=int, default=2048, help="output channels sampled per shape")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cfg = preset(args.preset, tp=args.tp)
    spec, shape = cfg.model, RankShape.of(cfg.model, args.tp, 0)
    g = torch.Generator().manual_seed(args.seed)
    out = {}
    for name, K in (("w_in", spec.dim), ("w_out", shape.out_proj_cols(spec))):
        a = torch.randn(spec.tokens_per_frame, K, generator=g)
        w = torch.randn(args.n, K, generator=g)
        (aq, sa), (wq, sw) = fp8.quantize_rows(a), fp8.quantize_rows(w)
        exact = a @ w.t()
        quant = fp8.scaled_mm(aq, sa, wq, sw[:, 0], torch.float32)
        out[name] = {"K": K, "fp8_inputs_rel_l2": rel(quant, exact),
                     "bf16_output_rounding_rel_l2": rel(quant.bfloat16().float(), quant)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
