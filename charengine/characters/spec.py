"""The characters family's model spec and presets: the shapes of its DiT and side networks,
and a TP rank's slice of them. Presets are data (`PRESETS`), never copied modules."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..mapping import split_evenly


@dataclass(frozen=True)
class SideSpec:
    """The networks around the DiT: audio encoder (every step, on the decoder's GPU), latent
    decoder (every step, its own GPU), image and text encoders (once per session).

    The characters-57b sizes are ours, set against the paper's timings of its decoder and
    audio encoder: a decoder of (768, 768, 384, 192, 192) channels with three convs per stage
    and a 4-layer audio encoder, timed by scripts/bench_sidenets.py (docs/PERFORMANCE.md,
    "Side networks at characters-57b size")."""

    sample_rate: int = 16000
    n_fft: int = 400
    hop: int = 160
    n_mels: int = 80
    audio_context: int = 32  # mel frames the encoder sees per step, ending at the step's end
    audio_width: int = 512
    audio_layers: int = 4
    audio_heads: int = 8
    decoder_channels: tuple[int, ...] = (768, 768, 384, 192, 192)
    decoder_convs: int = 3  # causal 3x3x3 convs per upsampling stage
    text_width: int = 512
    text_layers: int = 2
    text_heads: int = 8


TINY_SIDE = SideSpec(n_mels=40, audio_context=24, audio_width=32, audio_layers=1, audio_heads=2,
                     decoder_channels=(32, 32, 16, 16), decoder_convs=1, text_width=32, text_layers=1,
                     text_heads=2)


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of the characters DiT. Everything else (token counts, widths) is derived.

    The `characters-57b` numbers that the paper does not state are inferred:
    - width 7680 = 60 heads x 128: 16 d^2 = 944M parameters per block, 56.6B in 60 blocks
      (the paper's "about 57B"), and 60 heads split whole over 2..6 ranks;
    - a parallel block (attention and MLP side by side): one input projection
      d -> 3d (QKV) + 2 x 4d (SwiGLU gate, up) and one output projection (d + 4d) -> d,
      which is one all-reduce per block, as the paper says;
    - 757 tokens per latent = a 22 x 34 grid (704 x 1088 over a 16x VAE and 2x2 patches of
      48 latent channels) + 9 audio tokens;
    - 1,246 global slots = 748 reference-image tokens + 498 (padded) prompt tokens;
    - RoPE on head dim 128 split temporal 44 / height 42 / width 42, theta 10000.
    """

    name: str
    dim: int
    n_heads: int
    n_blocks: int
    mlp_ratio: int = 4
    mlp_align: int = 128  # TP splits the MLP hidden size in blocks of this many channels
    latent_channels: int = 48
    patch: int = 2
    vae_stride: int = 16  # output pixels per latent pixel, each spatial axis
    frames_per_latent: int = 4
    fps: int = 24
    grid_h: int = 22
    grid_w: int = 34
    audio_tokens: int = 9
    audio_dim: int = 1024  # width of the audio encoder's output features
    prompt_tokens: int = 498
    text_dim: int = 2048  # width of the text encoder's output features
    rope_split: tuple[int, int, int] = (44, 42, 42)  # temporal, height, width dims of a head
    rope_theta: float = 10000.0
    time_freq_dim: int = 256
    norm_eps: float = 1e-6
    side: SideSpec = field(default_factory=SideSpec)

    FAMILY = "characters"  # the model family (charengine/family.py); not a field
    NESTED = {"side": SideSpec}  # fields read back as dataclasses (config.from_dict_checked)

    def __post_init__(self):
        if len(self.side.decoder_channels) < max(self.frames_per_latent, self.vae_stride).bit_length():
            raise ValueError(f"{self.name}: side.decoder_channels needs one stage per 2x upsample")
        if self.dim % self.n_heads:
            raise ValueError(f"{self.name}: dim {self.dim} is not a multiple of n_heads {self.n_heads}")
        if sum(self.rope_split) != self.head_dim or any(s % 2 for s in self.rope_split):
            raise ValueError(
                f"{self.name}: rope_split {self.rope_split} must be three even sizes summing to "
                f"head_dim {self.head_dim}")
        if self.mlp_hidden % self.mlp_align:
            raise ValueError(f"{self.name}: MLP hidden {self.mlp_hidden} is not a multiple of "
                             f"mlp_align {self.mlp_align}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def mlp_hidden(self) -> int:
        return self.mlp_ratio * self.dim

    @property
    def video_tokens(self) -> int:
        return self.grid_h * self.grid_w

    @property
    def tokens_per_frame(self) -> int:
        """New tokens per AR step: one latent's video tokens plus its audio tokens."""
        return self.video_tokens + self.audio_tokens

    @property
    def global_tokens(self) -> int:
        """Reference-image tokens plus padded prompt tokens, written once per session."""
        return self.video_tokens + self.prompt_tokens

    @property
    def patch_dim(self) -> int:
        return self.latent_channels * self.patch * self.patch

    @property
    def latent_h(self) -> int:
        return self.grid_h * self.patch

    @property
    def latent_w(self) -> int:
        return self.grid_w * self.patch

    @property
    def out_h(self) -> int:
        return self.latent_h * self.vae_stride

    @property
    def out_w(self) -> int:
        return self.latent_w * self.vae_stride

    @property
    def steps_per_second(self) -> float:
        return self.fps / self.frames_per_latent

    @property
    def in_proj_dim(self) -> int:
        """QKV (3d) then SwiGLU gate and up (2 x hidden)."""
        return 3 * self.dim + 2 * self.mlp_hidden

    @property
    def out_proj_dim(self) -> int:
        """Attention output (d) then the MLP's hidden (hidden)."""
        return self.dim + self.mlp_hidden

    def block_linear_params(self) -> int:
        return self.n_blocks * (self.in_proj_dim * self.dim + self.dim * self.out_proj_dim)

    def check_tp(self, tp: int) -> None:
        """Heads are split whole over the TP ranks, MLP channels in blocks of mlp_align."""
        if tp < 1 or tp > self.n_heads:
            raise ValueError(
                f"tp={tp} does not fit {self.name}'s {self.n_heads} heads: heads are split "
                f"whole, so use 1 <= tp <= {self.n_heads}.")
        mlp_blocks = self.mlp_hidden // self.mlp_align
        if tp > mlp_blocks:
            raise ValueError(f"tp={tp} exceeds the {mlp_blocks} MLP blocks of "
                             f"{self.mlp_align} channels")


TINY = ModelSpec(
    name="tiny", dim=64, n_heads=4, n_blocks=2, mlp_align=16, latent_channels=8, vae_stride=8,
    grid_h=4, grid_w=4, audio_tokens=1, audio_dim=32, prompt_tokens=8, text_dim=32,
    rope_split=(6, 4, 6), time_freq_dim=32, side=TINY_SIDE)

PRESETS: dict[str, ModelSpec] = {
    "characters-57b": ModelSpec(name="characters-57b", dim=7680, n_heads=60, n_blocks=60),
    "tiny": TINY,
    # Ten heads: splits unevenly over 3, 4 and 7 ranks; the uneven-TP tests use it.
    "tiny-10h": dataclasses.replace(TINY, name="tiny-10h", dim=80, n_heads=10,
                                    rope_split=(2, 2, 4)),
    # Head dim 64: the smallest tiny model every GPU kernel serves (FP8 attention needs a
    # power-of-two head dim of at least 32); the GPU tests of kernels and engines use it.
    "tiny-d64": dataclasses.replace(TINY, name="tiny-d64", dim=128, n_heads=2,
                                    rope_split=(22, 20, 22)),
}


@dataclass(frozen=True)
class RankShape:
    """One tensor-parallel rank's slice: whole heads, and MLP channels in aligned blocks."""

    tp: int
    rank: int
    head_offset: int
    heads: int
    mlp_offset: int
    mlp: int

    @classmethod
    def of(cls, spec: ModelSpec, tp: int, rank: int) -> "RankShape":
        if not 0 <= rank < tp:
            raise ValueError(f"rank {rank} outside TP group of {tp}")
        h0, h = split_evenly(spec.n_heads, tp, rank)
        b0, b = split_evenly(spec.mlp_hidden // spec.mlp_align, tp, rank)
        return cls(tp, rank, h0, h, b0 * spec.mlp_align, b * spec.mlp_align)

    def attn_width(self, spec: ModelSpec) -> int:
        return self.heads * spec.head_dim

    def in_proj_rows(self, spec: ModelSpec) -> int:
        return 3 * self.attn_width(spec) + 2 * self.mlp

    def out_proj_cols(self, spec: ModelSpec) -> int:
        return self.attn_width(spec) + self.mlp
