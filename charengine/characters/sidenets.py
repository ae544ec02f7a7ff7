"""The side networks as one module tree, so they load and save as one state dict with the
prefixes audio_encoder., decoder., image_encoder., text_encoder."""

from __future__ import annotations

import torch

from .audio import AudioEncoder
from .spec import ModelSpec
from .decoder import Decoder, ImageEncoder, SessionDecoder
from .text import TextEncoder

PREFIXES = ("audio_encoder.", "decoder.", "image_encoder.", "text_encoder.")


class SideNets(torch.nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.audio_encoder = AudioEncoder(spec)
        self.decoder = Decoder(spec)
        self.image_encoder = ImageEncoder(spec)
        self.text_encoder = TextEncoder(spec)


def session_decoder(side: SideNets) -> SessionDecoder:
    """A decoder of its own causal state over the side networks' decoder weights."""
    return SessionDecoder(side.decoder)


def side_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every side-network tensor's name and shape (built on the meta device: no memory)."""
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in SideNets(spec).state_dict().items()}


def check_side(spec: ModelSpec, state: dict[str, torch.Tensor], where: str) -> None:
    """A checkpoint's side networks, checked like its block tensors: names, shapes, dtypes
    and finite values, one line naming the first tensor that is wrong."""
    from ..checkpoint import check_tensors

    check_tensors(side_shapes(spec), state, where, f"{spec.name}'s side networks")


def random_side_state(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return {k: v.detach().clone() for k, v in SideNets(spec).state_dict().items()}


def load_side(spec: ModelSpec, state: dict[str, torch.Tensor], device="cpu") -> SideNets:
    nets = SideNets(spec)
    missing, unexpected = nets.load_state_dict(state, strict=False)
    if missing or unexpected:
        name = (missing or unexpected)[0]
        raise ValueError(f"side networks: {'missing' if missing else 'unexpected'} tensor {name!r}")
    return nets.to(device).eval()
