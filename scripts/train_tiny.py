"""Train the tiny character from procedural clips (tinychar.synth), on the CPU, with a fixed
seed.

Stage `vae`: the latent encoder / decoder pair (4 frames <-> one latent; the decoder is the
engine's causal decoder) and the image encoder (one reference frame -> its latent). Latents
are scaled to unit variance per channel, folded into the encoder and decoder weights.

Stage `dit`: the `tiny` DiT and the audio encoder, by flow matching on the VAE's latents of
fresh clips, with the engine's semantics (tinychar.sequence): every frame of a training
window at one noise level (drawn from the four-pass schedule three times in four, else
uniform), block-causal attention over the cache window plus the reference image's and the
prompt's global tokens, temporal indices where the engine puts them. The checkpoint holds
the DiT and every side network (the text encoder stays at its seeded initialization;
prompts are random strings or empty, so the model learns to take them as they come).

    python scripts/train_tiny.py vae --steps 1200 --out charengine/checkpoints/tiny_vae.safetensors
    python scripts/train_tiny.py dit --steps 4000 --out charengine/checkpoints/tiny.safetensors
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from safetensors.torch import load_file

from charengine.characters import audio as audio_mod
from charengine.characters.spec import PRESETS
from charengine.config import EngineConfig
from charengine.characters.decoder import Decoder, ImageEncoder, VideoEncoder
from charengine.characters.model import patchify
from tinychar.quality import psnr
from tinychar.sequence import SequenceDiT
from charengine.characters.sidenets import SideNets
from tinychar.synth import clip
from charengine.characters.weights import random_weights


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


def prefixed(state: dict, prefix: str) -> dict:
    """The tensors under `prefix` ("decoder."), named without it."""
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def load_vae(spec, path: Path):
    state = load_file(str(path))
    enc, dec, img = VideoEncoder(spec), Decoder(spec), ImageEncoder(spec)
    for prefix, net in (("video_encoder.", enc), ("decoder.", dec), ("image_encoder.", img)):
        net.load_state_dict(prefixed(state, prefix))
    return enc.eval(), dec.eval(), img.eval()


def random_prompt(rng: np.random.Generator) -> str:
    """Empty half the time, else a few random lowercase words."""
    if rng.random() < 0.5:
        return ""
    words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), rng.integers(2, 8)))
             for _ in range(rng.integers(1, 4))]
    return " ".join(words)


@torch.no_grad()
def prepare_dit_data(spec, enc, img, text, n: int, seconds: float, seed: int) -> dict:
    """Per clip: patchified latents [L, V, patch_dim], the reference latent (first frame),
    each step's log-mel window [L, n_mels, context], prompt features."""
    rng = np.random.default_rng(seed)
    mel = audio_mod.AudioEncoder(spec)
    lat, ref, mels, prompts = [], [], [], []
    for _ in range(n):
        c = clip(seconds, spec.out_h, rng)
        frames = torch.from_numpy(c.frames).permute(3, 0, 1, 2).float() / 255  # [3, T, H, W]
        z = enc(frames[None])[0]  # [C, L, h, w]
        L = z.shape[1]
        lat.append(torch.stack([patchify(z[:, k], spec.patch) for k in range(L)]))
        ref.append(patchify(img(frames[:, 0]), spec.patch))
        speech = torch.from_numpy(c.audio)
        windows = torch.stack([audio_mod.step_window(spec, speech, k) for k in range(L)])
        mels.append(mel.log_mel(windows))
        prompts.append(text(random_prompt(rng)))
    return {"lat": torch.stack(lat), "ref": torch.stack(ref), "mel": torch.stack(mels),
            "prompt": torch.stack(prompts)}


def train_dit(args) -> dict:
    spec = PRESETS["tiny"]
    cfg = EngineConfig(model=spec)
    torch.manual_seed(args.seed)
    enc, dec, img = load_vae(spec, args.vae)
    side = SideNets(spec)  # seeded: the text encoder's weights are part of the checkpoint
    side.decoder.load_state_dict(dec.state_dict())
    side.image_encoder.load_state_dict(img.state_dict())
    init = random_weights(spec, args.seed)
    if args.init is not None:  # continue from a checkpoint: its DiT, audio and text encoders
        state = load_file(str(args.init))
        init = {k: state[k] for k in init}
        for name in ("audio_encoder", "text_encoder"):
            getattr(side, name).load_state_dict(prefixed(state, name + "."))
    t0 = time.time()
    data = prepare_dit_data(spec, enc, img, side.text_encoder, args.clips, args.seconds, args.seed)
    print(f"dit data: {tuple(data['lat'].shape)} latents ({time.time() - t0:.0f} s)", flush=True)
    model = SequenceDiT(cfg, init)
    audio = side.audio_encoder
    params = [*model.parameters(), *audio.parameters()]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, total_steps=args.steps,
                                                pct_start=0.05)
    g = torch.Generator().manual_seed(args.seed)
    sigmas = torch.tensor(cfg.schedule.sigmas)
    cc, W = cfg.cache, args.seq_latents
    lo, hi = cc.first_temporal_index - (cc.window - 1), cc.first_temporal_index + cc.reset_period - 1
    n_clips, n_lat = data["lat"].shape[:2]
    losses = []
    for step in range(args.steps):
        idx = torch.randint(0, n_clips, (args.batch,), generator=g)
        start = torch.randint(0, n_lat - W + 1, (args.batch,), generator=g)
        sel = start[:, None] + torch.arange(W)
        x0 = data["lat"][idx[:, None], sel]  # [B, W, V, pd]
        mel = data["mel"][idx[:, None], sel].flatten(0, 1)
        feats = audio.features(mel).reshape(args.batch, W, spec.audio_tokens, spec.audio_dim)
        pick = torch.randint(0, len(sigmas), (args.batch,), generator=g)
        uniform = torch.rand(args.batch, generator=g) * 0.98 + 0.02
        sigma = torch.where(torch.rand(args.batch, generator=g) < 0.75, sigmas[pick], uniform)
        eps = torch.randn(x0.shape, generator=g)
        s4 = sigma[:, None, None, None]
        xs = (1 - s4) * x0 + s4 * eps
        t_first = torch.randint(lo, hi - W + 2, (args.batch,), generator=g)
        temporal = t_first[:, None] + torch.arange(W)
        v = model(xs, feats, data["ref"][idx], data["prompt"][idx], sigma, temporal)
        loss = ((v - (eps - x0)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 100 == 0 or step == args.steps - 1:
            print(f"dit step {step}: loss {np.mean(losses[-100:]):.4f} ({time.time() - t0:.0f} s)",
                  flush=True)
    state = {k: v.detach() for k, v in model.state().items()}
    state |= {k: v.detach() for k, v in side.state_dict().items()}
    report = {"final_loss_100": float(np.mean(losses[-100:])), "first_loss_100": float(np.mean(losses[:100])),
              "wall_s": time.time() - t0, "latents": int(n_clips * n_lat), "args": vars(args)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(args.out),
              metadata={"report": json.dumps(report, default=str)})
    return report


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["vae", "dit"])
    ap.add_argument("--out", type=Path, default=None,
                    help="default: charengine/checkpoints/tiny_vae.safetensors (vae), "
                         "charengine/checkpoints/tiny.safetensors (dit)")
    ap.add_argument("--vae", type=Path, default=Path("charengine/checkpoints/tiny_vae.safetensors"),
                    help="dit: the trained VAE whose latents the DiT learns")
    ap.add_argument("--init", type=Path, default=None,
                    help="dit: continue from this checkpoint's DiT and audio encoder")
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--image-steps", type=int, default=400)
    ap.add_argument("--clips", type=int, default=48)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-latents", type=int, default=3,
                    help="latents per training window (vae: 3; dit: use 8, past the cache window)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--latent-l2", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(2)
    if args.out is None:
        args.out = Path("charengine/checkpoints/tiny_vae.safetensors" if args.stage == "vae"
                        else "charengine/checkpoints/tiny.safetensors")
    report = train_vae(args) if args.stage == "vae" else train_dit(args)
    print(json.dumps({k: v for k, v in report.items() if k != "args"}, indent=1))


if __name__ == "__main__":
    main()
