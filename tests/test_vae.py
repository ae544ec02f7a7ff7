"""The shipped tiny VAE (charengine/checkpoints/tiny_vae.safetensors, from scripts/train_tiny.py vae):
held-out clips (identities and speech never seen in training) reconstruct, the streaming
decoder gives the same frames, and the image encoder lands near the video encoder's latent."""

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from charengine.characters.spec import PRESETS
from charengine.characters.decoder import Decoder, ImageEncoder, VideoEncoder
from tinychar.quality import psnr
from tinychar.synth import clip

CKPT = Path(__file__).resolve().parents[1] / "charengine" / "checkpoints" / "tiny_vae.safetensors"
SPEC = PRESETS["tiny"]


def load(module, prefix, state):
    module.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
    return module.eval()


def test_vae_reconstructs_held_out_clips():
    state = load_file(str(CKPT))
    enc = load(VideoEncoder(SPEC), "video_encoder.", state)
    dec = load(Decoder(SPEC), "decoder.", state)
    img = load(ImageEncoder(SPEC), "image_encoder.", state)
    rng = np.random.default_rng(424242)  # not a training seed
    scores, rel = [], []
    with torch.no_grad():
        for _ in range(3):
            c = clip(3.0, SPEC.out_h, rng)
            x = torch.from_numpy(c.frames).permute(3, 0, 1, 2).float()[None] / 255
            z = enc(x)
            assert abs(float(z.std()) - 1) < 0.5  # latents near unit scale for diffusion
            dec.reset()
            y = torch.cat([dec(z[0, :, i]).transpose(0, 1) for i in range(z.shape[2])], dim=1)
            a = (x[0].permute(1, 2, 3, 0) * 255).round().byte().numpy()
            b = (y.permute(1, 2, 3, 0) * 255).round().byte().numpy()
            scores.append(np.mean([psnr(a[i], b[i]) for i in range(len(a))]))
            ref = enc(x[:, :, :1].expand(-1, -1, 4, -1, -1))[0, :, 0]
            rel.append(float((img(x[0, :, 0]) - ref).norm() / ref.norm()))
    assert min(scores) > PSNR_FLOOR, scores
    assert max(rel) < 0.5, rel


PSNR_FLOOR = 18.0  # below every held-out clip's PSNR (docs/PERFORMANCE_LOG.md, "The tiny VAE")
