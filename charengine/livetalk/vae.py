"""The Wan 2.1 VAE (`Wan2.1_VAE.pth`) as LiveTalk uses it: the reference image's latent, and
the streaming decode of generated latents to video frames.

A causal 3-D conv autoencoder: 16 latent channels, 8 x 8 pixels per latent pixel, 4 video frames
per latent frame after the first (which gives one). Latents outside the VAE are normalized per
channel with the fixed Wan 2.1 mean and standard deviation: (mu - mean) / std, computed in the
VAE's dtype as (mu - mean) * (1 / std), and decoded as z / (1 / std) + mean. Decoded frames are
clamped to [-1, 1] and mapped to [0, 1].
"""

from __future__ import annotations

import pickle
import warnings
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..checkpoint import CheckpointError, check_tensors
from ..paths import not_a_file
from .vae_blocks import CausalConv3d, Decoder, Encoder, StreamState

WHAT = "the Wan 2.1 VAE"

# Per-channel statistics of Wan 2.1 latents (the normalization the DiT was trained with).
WAN21_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
              0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
WAN21_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
             3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160)


@dataclass(frozen=True)
class VaeSpec:
    """Shapes of the VAE: base width `dim` times `dim_mult` per stage, `num_res_blocks` per
    encoder stage (one more per decoder stage), a 2x spatial resample between stages, temporal
    in the stages marked by `temporal_downsample` (mirrored in the decoder); `mean` and `std`
    normalize the `z_dim` latent channels."""

    z_dim: int = 16
    dim: int = 96
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    temporal_downsample: tuple[bool, ...] = (False, True, True)
    mean: tuple[float, ...] = WAN21_MEAN
    std: tuple[float, ...] = WAN21_STD
    # the VAE's dtype where it runs on a GPU (fp32 on a CPU): bf16, the faster, its frames
    # close to fp32's (measured by scripts/bench_livetalk_sidenets.py; docs/PERFORMANCE_LOG.md)
    gpu_dtype: str = "bfloat16"

    def __post_init__(self):
        for name in ("dim_mult", "temporal_downsample", "mean", "std"):  # JSON gives lists
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if len(self.mean) != self.z_dim or len(self.std) != self.z_dim:
            raise ValueError(f"VAE: mean and std need {self.z_dim} values each (z_dim)")
        if len(self.temporal_downsample) != len(self.dim_mult) - 1:
            raise ValueError("VAE: temporal_downsample needs one flag per resample "
                             f"({len(self.dim_mult) - 1})")
        if any(s <= 0 for s in self.std):
            raise ValueError("VAE: std values must be positive")

    @property
    def spatial_stride(self) -> int:
        return 2 ** (len(self.dim_mult) - 1)

    @property
    def time_stride(self) -> int:
        return 2 ** sum(self.temporal_downsample)

    def video_frames(self, latent_frames: int) -> int:
        """Video frames a session's first `latent_frames` latents decode to."""
        return 0 if latent_frames <= 0 else 1 + (latent_frames - 1) * self.time_stride


WAN21 = VaeSpec()
TINY = VaeSpec(dim=8, dim_mult=(1, 2, 2, 2), num_res_blocks=1)


class WanVAE(nn.Module):
    """The VAE; its state dict is exactly the checkpoint's (encoder.*, conv1.*, conv2.*,
    decoder.*). `encode` gives normalized latents; decode through `StreamingDecoder`."""

    def __init__(self, spec: VaeSpec = WAN21):
        super().__init__()
        self.spec = spec
        self.encoder = Encoder(spec)
        self.conv1 = CausalConv3d(2 * spec.z_dim, 2 * spec.z_dim, 1)  # -> mean, log-variance
        self.conv2 = CausalConv3d(spec.z_dim, spec.z_dim, 1)  # latent -> decoder input
        self.decoder = Decoder(spec)

    @classmethod
    def from_checkpoint(cls, path: str | Path, spec: VaeSpec = WAN21,
                        device: torch.device | str = "cpu",
                        dtype: torch.dtype = torch.float32) -> WanVAE:
        """The checked checkpoint at `path`, in `dtype` on `device`, for inference."""
        state = load_vae(path, spec)
        with torch.device("meta"):
            vae = cls(spec)
        vae.load_state_dict(state, assign=True)
        return vae.to(device=device, dtype=dtype).eval().requires_grad_(False)

    def latent_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, 1 / std) as [1, z, 1, 1, 1] in the VAE's dtype and device."""
        p = self.conv2.weight
        mean = torch.tensor(self.spec.mean, dtype=torch.float32).to(p.device, p.dtype)
        std = torch.tensor(self.spec.std, dtype=torch.float32).to(p.device, p.dtype)
        shape = (1, self.spec.z_dim, 1, 1, 1)
        return mean.view(shape), (1.0 / std).view(shape)

    @torch.no_grad()
    def encode(self, video: torch.Tensor) -> torch.Tensor:
        """Video [B, 3, 1 + 4k, H, W] in [-1, 1] -> normalized latents (the posterior mean)
        [B, z, 1 + k, H/8, W/8] in the VAE's dtype."""
        s = self.spec
        if video.dim() != 5 or video.shape[1] != 3 or (video.shape[2] - 1) % s.time_stride:
            raise ValueError(f"VAE encode: want video [B, 3, 1 + {s.time_stride} k, H, W], "
                             f"got {list(video.shape)}")
        if video.shape[3] % s.spatial_stride or video.shape[4] % s.spatial_stride:
            raise ValueError(f"VAE encode: height and width must be multiples of "
                             f"{s.spatial_stride}, got {video.shape[3]} x {video.shape[4]}")
        p = self.conv1.weight
        mu = self.conv1(self.encoder(video.to(p.device, p.dtype)))[:, :s.z_dim]
        mean, inv_std = self.latent_stats()
        return (mu - mean) * inv_std


def vae_shapes(spec: VaeSpec = WAN21) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every checkpoint tensor (built on the meta device: no memory)."""
    with torch.device("meta"):
        vae = WanVAE(spec)
    return {k: tuple(v.shape) for k, v in vae.state_dict().items()}


def load_vae(path: str | Path, spec: VaeSpec = WAN21) -> dict[str, torch.Tensor]:
    """The tensors of a `Wan2.1_VAE.pth`-style torch file (a flat state dict), checked against
    `spec`. Only tensors are unpickled; anything else, a missing or unreadable file, or a
    missing, extra, misshapen or non-finite tensor is one CheckpointError line."""
    path = Path(path)
    if (why := not_a_file(path)) is not None:
        raise CheckpointError(f"{path}: {why} ({WHAT}, Wan2.1_VAE.pth)")
    try:
        with warnings.catch_warnings():  # torch's notes on a file it refuses: the line says it
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError, KeyError, ValueError,
            IndexError, TypeError, AttributeError) as e:  # what a damaged or foreign file raises
        raise CheckpointError(f"{path}: {_load_failure(e)}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: holds a {type(state).__name__}, {WHAT} is a dict of "
                              "tensors")
    for k, v in state.items():
        if not isinstance(k, str) or not isinstance(v, torch.Tensor):
            raise CheckpointError(f"{path}: entry {k!r} is a {type(v).__name__}, not a tensor "
                                  f"({WHAT} is a flat dict of tensors)")
    check_tensors(vae_shapes(spec), state, str(path), WHAT)
    return state


# how torch names the global a weights_only load refused, across its versions' wordings
REFUSED_GLOBAL = re.compile(r"(?:unsupported global: GLOBAL|load unsupported GLOBAL)\s+(\S+)",
                            re.IGNORECASE)


def _load_failure(e: Exception) -> str:
    """One line for a torch.load(weights_only=True) failure. Never torch's own advice, which
    is to load the file again with weights_only=False (that would run what it pickles)."""
    text = str(e)
    found = REFUSED_GLOBAL.search(text)
    if found:
        return (f"refused: it pickles {found.group(1)}, not a tensor (nothing but tensors is "
                f"ever unpickled; {WHAT} is a flat dict of tensors)")
    detail = re.search(r"WeightsUnpickler error: \s*(.+)", text)
    if detail is None and isinstance(e, pickle.UnpicklingError) and "weights_only" in text:
        return (f"refused: it holds something other than tensors (nothing but tensors is ever "
                f"unpickled; {WHAT} is a flat dict of tensors)")
    lines = [ln.strip() for ln in text.splitlines()
             if ln.strip() and "weights_only" not in ln]
    line = detail.group(1) if detail else (lines or [""])[0]
    return f"not a readable torch file ({type(e).__name__}{': ' + line.strip() if line else ''})"


@torch.no_grad()
def encode_image(vae: WanVAE, image: torch.Tensor) -> torch.Tensor:
    """Reference image [3, H, W] in [0, 1] -> its normalized latent [z, H/8, W/8] (float32)."""
    if image.dim() != 3 or image.shape[0] != 3:
        raise ValueError(f"encode_image: want an image [3, H, W], got {list(image.shape)}")
    x = image.float() * 2.0 - 1.0
    return vae.encode(x[None, :, None])[0, :, 0].float()


class StreamingDecoder:
    """Decodes a session's normalized latents [z, F, h, w], any F >= 1 per call, to frames
    [n, 3, 8 h, 8 w] float32 in [0, 1]: the session's first latent gives 1 frame, every later
    one 4. Each temporal conv's last two input frames carry across calls (tensors allocated on
    the first call and updated in place), so any split of a session into calls gives the
    frames of decoding it whole. `reset()` starts a new session."""

    def __init__(self, vae: WanVAE):
        self.vae = vae
        self.spec = vae.spec
        self.mean, self.inv_std = vae.latent_stats()
        self.state = StreamState()

    @property
    def started(self) -> bool:
        return self.state.started

    @torch.no_grad()
    def reset(self) -> None:
        self.state.reset()

    def per_latent(self, latents: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A step's latents [z, F, h, w] as calls of one latent each, in order, except that a
        session's first latent (one frame) goes with the next (so no call gives fewer than
        4 frames): decoded one after the other they give the frames of the whole (a live
        session hands each call's frames on as they are decoded)."""
        first = 1 if self.started or latents.shape[1] < 2 else 2
        return (latents[:, :first], *latents[:, first:].split(1, dim=1))

    @torch.no_grad()
    def __call__(self, latents: torch.Tensor) -> torch.Tensor:
        s = self.spec
        if latents.dim() != 4 or latents.shape[0] != s.z_dim or latents.shape[1] < 1:
            raise ValueError(f"StreamingDecoder: want latents [{s.z_dim}, F >= 1, h, w], got "
                             f"{list(latents.shape)}")
        z = latents.to(self.mean.device, self.mean.dtype).unsqueeze(0)
        z = z / self.inv_std + self.mean
        x = self.vae.decoder(self.vae.conv2(z), self.state)
        self.state.started = True
        x = x[0].transpose(0, 1).to(torch.float32, memory_format=torch.contiguous_format)
        return (x.clamp(-1.0, 1.0) * 0.5 + 0.5).clamp(0.0, 1.0)
