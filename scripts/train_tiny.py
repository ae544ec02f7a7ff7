"""Train the tiny character from procedural clips (charengine.synth), on the CPU, with a fixed
seed. Stage `vae`: the latent encoder / decoder pair (4 frames <-> one latent; the decoder is
the engine's causal decoder) and the image encoder (one reference frame -> its latent).
Latents are scaled to unit variance per channel, folded into the encoder and decoder weights.

    python scripts/train_tiny.py vae --steps 1200 --out checkpoints/tiny_vae.safetensors
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from charengine.config import PRESETS
from charengine.decoder import Decoder, ImageEncoder, VideoEncoder
from charengine.quality import psnr
from charengine.synth import clip


def clip_frames(n: int, seconds: float, seed: int, size: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    clips = [clip(seconds, size, rng) for _ in range(n)]
    return torch.from_numpy(np.stack([c.frames for c in clips])).permute(0, 4, 1, 2, 3).float() / 255


def train_vae(args) -> dict:
    spec = PRESETS["tiny"]
    torch.manual_seed(args.seed)
    data = clip_frames(args.clips, args.seconds, args.seed, spec.out_h)  # [N, 3, T, H, W]
    n4 = spec.frames_per_latent
    enc, dec, img = VideoEncoder(spec), Decoder(spec), ImageEncoder(spec)
    opt = torch.optim.Adam([*enc.parameters(), *dec.parameters()], lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.steps)
    g = torch.Generator().manual_seed(args.seed)
    seq = args.seq_latents * n4
    t0 = time.time()
    for step in range(args.steps):
        idx = torch.randint(0, data.shape[0], (args.batch,), generator=g)
        start = int(torch.randint(0, data.shape[2] // n4 - args.seq_latents + 1, (1,), generator=g)) * n4
        x = data[idx, :, start: start + seq]
        dec.reset()
        z = enc(x)
        y = dec.forward_sequence(z)
        loss = ((y - x) ** 2).mean() + args.latent_l2 * (z ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 100 == 0:
            print(f"vae step {step}: loss {loss.item():.5f} ({time.time() - t0:.0f} s)", flush=True)
    # unit variance per latent channel, folded into the weights (exact: scaling only)
    with torch.no_grad():
        z = torch.cat([enc(data[i: i + 1, :, : 12 * n4]) for i in range(data.shape[0])])
        s = z.transpose(0, 1).reshape(spec.latent_channels, -1).std(dim=1)
        enc.conv_out.weight /= s[:, None, None, None]
        enc.conv_out.bias /= s
        dec.conv_in.conv.weight *= s[None, :, None, None, None]
    # the image encoder: a reference frame -> the latent of that frame held for 4 frames
    opt = torch.optim.Adam(img.parameters(), lr=args.lr)
    for step in range(args.image_steps):
        idx = torch.randint(0, data.shape[0], (args.batch,), generator=g)
        t = torch.randint(0, data.shape[2], (1,), generator=g).item()
        frame = data[idx, :, t]
        with torch.no_grad():
            target = enc(frame[:, :, None].expand(-1, -1, n4, -1, -1))[:, :, 0]
        pred = torch.stack([img(f) for f in frame])
        loss = ((pred - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    # held-out reconstruction
    held = clip_frames(4, args.seconds, args.seed + 10**6, spec.out_h)
    with torch.no_grad():
        scores = []
        for c in held:
            dec.reset()
            y = dec.forward_sequence(enc(c[None]))[0]
            a = (c.permute(1, 2, 3, 0) * 255).round().byte().numpy()
            b = (y.permute(1, 2, 3, 0) * 255).round().byte().numpy()
            scores.append(np.mean([psnr(a[i], b[i]) for i in range(len(a))]))
    state = {**{f"decoder.{k}": v for k, v in dec.state_dict().items()},
             **{f"image_encoder.{k}": v for k, v in img.state_dict().items()},
             **{f"video_encoder.{k}": v for k, v in enc.state_dict().items()}}
    report = {"heldout_psnr_db": float(np.mean(scores)), "latent_scale": s.tolist(),
              "final_loss": float(loss), "wall_s": time.time() - t0, "args": vars(args)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(args.out),
              metadata={"report": json.dumps(report, default=str)})
    return report


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["vae"])
    ap.add_argument("--out", type=Path, default=Path("checkpoints/tiny_vae.safetensors"))
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--image-steps", type=int, default=400)
    ap.add_argument("--clips", type=int, default=48)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-latents", type=int, default=3)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--latent-l2", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(2)
    report = train_vae(args)
    print(json.dumps({k: v for k, v in report.items() if k != "args"}, indent=1))


if __name__ == "__main__":
    main()
