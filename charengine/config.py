"""Configuration: the model spec and its presets, schedule, cache geometry, switches, numerics.

One frozen `EngineConfig` describes what a step computes and which optimizations are on.
Presets are data (`PRESETS`), never copied modules. Invalid combinations fail at
construction with a message that says what to change.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SideSpec:
    """The networks around the DiT: audio encoder (every step, on the decoder's GPU), latent
    decoder (every step, its own GPU), image and text encoders (once per session).

    The characters-57b sizes are ours, set against the paper's timings: its decoder takes
    114 ms per latent on an H100 in bf16; ours, (768, 768, 384, 192, 192) channels with three
    convs per stage (33 TFLOP), takes 104 ms on the H200 (scripts/bench_sidenets.py,
    docs/PERFORMANCE.md). Its audio encoder takes 9 ms per step; ours takes about 2."""

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

    The `characters-57b` numbers that the paper does not state are inferred (DESIGN.md §2):
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
class CacheSpec:
    """Geometry of each (block, pass) KV cache: global slots + a window of latent frames.

    A window frame written at AR step k has temporal index window + 1 + (k mod reset_period);
    every reset_period steps the cached window keys move by -reset_period (the delta rotation),
    so indices stay in [2, window + reset_period]. Global tokens have temporal index 0.
    """

    window: int = 6
    reset_period: int = 42
    calibration_steps: int = 6  # FP8 KV scales are set on entering step calibration_steps + 1
    scale_margin: float = 1.5
    fp8_max: float = 448.0

    @property
    def first_temporal_index(self) -> int:
        return self.window + 1

    @property
    def delta(self) -> int:
        return -self.reset_period


@dataclass(frozen=True)
class Schedule:
    """The fixed flow-matching schedule: one denoising pass per sigma, Euler steps to 0."""

    sigmas: tuple[float, ...] = (1.0, 0.75, 0.5, 0.25)

    @property
    def passes(self) -> int:
        return len(self.sigmas)

    def next_sigma(self, p: int) -> float:
        return self.sigmas[p + 1] if p + 1 < self.passes else 0.0


@dataclass(frozen=True)
class Switches:
    """One switch per optimization, in the order of the paper's Figure 2. All off is the
    paper's baseline; each plain path stays runnable and tested against the fast one."""

    baked_adaln: bool = True  # modulation table [pass, block, 3, d] instead of a per-call MLP
    rope_at_write: bool = True  # RoPE on new Q/K once, instead of the whole cache per call
    ring_cache: bool = True  # ring of window slots at a device write position, not shift-left
    fp8_kv: bool = True  # K/V stored FP8 with per-(block, head) scales, not requantized per call
    delta_rotation: bool = True  # rotate cached window keys by omega * delta at each reset
    conditioning_cache: bool = True  # RoPE tables and conditioning built once per step
    fused_pre_attention: bool = True  # norm + RoPE + quantize + ring write in one plugin op
    fused_act_quant: bool = True  # norm/modulate or SwiGLU + per-token FP8 quant in one kernel
    # These act where there is something to act on: an FP8 cache, a delta rotation.
    fp8_attention_kernel: bool = True  # FP8 dots over the FP8 ring, no per-call dequantization
    fused_delta_rotation: bool = True  # the reset's rotation of every FP8 cache in one kernel
    fused_residual: bool = True  # gated residual add inside the next block's norm + quant
    fused_calibration: bool = True  # FP8 KV calibration of every cache in two kernels
    fused_gemm_allreduce: bool = True  # output projection GEMM and TP all-reduce fused
    # The gated residual add in the output projection's epilogue (the C input of cuBLASLt or
    # QuACK, as the GEMM plan says; the AdaLN gate folded into the weight scale per pass),
    # taking over from fused_residual where the GEMMs are FP8 and AdaLN is baked. Off: with
    # cuBLASLt it moves time from activation quantization into the GEMMs and leaves the TP-3
    # step where it was (docs/PERFORMANCE.md, "The residual add in the GEMM epilogue"); on
    # with gemm_swiglu in the target h100-tp3-quack. Not a waterfall arm.
    gemm_residual: bool = False
    # SwiGLU in the input projection's epilogue, with each row's |max| (QuACK; the projection
    # split into a q/k/v GEMM and a (gate, up)-paired one), the FP8 attention kernel giving
    # its rows' |max| too, and the output projection's input quantized with no row reduction
    # (plugins/quack_gemm.py, plugins/act_quant.concat_quant_reference); measured with
    # gemm_residual in docs/PERFORMANCE.md, "The block's quantizations in the GEMM
    # epilogues". Needs quack-kernels on a GPU, an optional extra, so it is off but in the
    # target h100-tp3-quack; the plain path is the references, on any device. Not a
    # waterfall arm.
    gemm_swiglu: bool = False

    # Figure 2's order; the FP8 attention kernel and the fused delta rotation (the paper's
    # baseline already had FP8 attention, and it does not break out the reset) come last
    # before the fused all-reduce; the fused residual add and the fused calibration (ours, the
    # latter acting on the session's one calibration step) after them. Switches off by
    # default are not arms (cumulative leaves them at their default).
    ORDER = ("baked_adaln", "rope_at_write", "ring_cache", "fp8_kv", "conditioning_cache",
             "fused_pre_attention", "fused_act_quant", "fp8_attention_kernel",
             "fused_delta_rotation", "fused_residual", "fused_calibration",
             "fused_gemm_allreduce")

    @classmethod
    def baseline(cls) -> "Switches":
        return cls(**{f.name: False for f in dataclasses.fields(cls)})

    @classmethod
    def cumulative(cls, upto: str) -> "Switches":
        """Baseline plus every switch in ORDER up to and including `upto` (the waterfall arms).
        RoPE at write brings the delta rotation with it."""
        if upto == "baseline":
            return cls.baseline()
        on = cls.ORDER[: cls.ORDER.index(upto) + 1]
        kw = {name: name in on for name in cls.ORDER}
        kw["delta_rotation"] = kw["rope_at_write"]
        return cls(**kw)


@dataclass(frozen=True)
class Numerics:
    """What precision each part runs in. Not an optimization switch: these change the output.

    fp8_gemm: block linears take per-token FP8 activations (weights are always stored FP8 with
    per-output-channel scales). fp8_attention: attention reads FP8 K/V (the paper's production
    and baseline both do; off gives the paper's "bf16 cache" arm).
    """

    dtype: str = "bfloat16"  # activations and the unquantized cache: "bfloat16" or "float32"
    fp8_gemm: bool = True
    fp8_attention: bool = True
    # FP8 GEMMs without promoting partial sums to fp32 (GPU only), as vLLM's sm90 FP8 GEMMs
    # run: 2.7e-3 relative error at K = 12,800 against 1.3e-4 promoted, both far below the
    # 3.7e-2 of FP8 quantization itself; 6.2 ms off the TP-3 step (docs/PERFORMANCE.md)
    fast_accum: bool = True
    LINEARS = ("w_in", "w_out")  # the block linears (not a field)
    # the block linears fast_accum applies to: "w_in" (input projection, sums over dim) and
    # "w_out" (output projection, sums over the attention and MLP widths)
    fast_accum_linears: tuple[str, ...] = LINEARS

    def __post_init__(self):
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"numerics.dtype must be 'bfloat16' or 'float32', not {self.dtype!r}")
        linears = tuple(self.fast_accum_linears)  # a list when read back from JSON
        unknown = [x for x in linears if x not in self.LINEARS]
        if unknown:
            raise ValueError(f"numerics.fast_accum_linears: unknown {unknown}; known: "
                             f"{', '.join(self.LINEARS)}")
        object.__setattr__(self, "fast_accum_linears", linears)

    def fast_accum_for(self, linear: str) -> bool:
        """Whether block linear `linear` ("w_in" or "w_out") accumulates without promotion."""
        return self.fast_accum and linear in self.fast_accum_linears


@dataclass(frozen=True)
class EngineConfig:
    model: ModelSpec
    cache: CacheSpec = field(default_factory=CacheSpec)
    schedule: Schedule = field(default_factory=Schedule)
    switches: Switches = field(default_factory=Switches)
    numerics: Numerics = field(default_factory=Numerics)
    tp: int = 1

    def __post_init__(self):
        s, c = self.switches, self.cache
        if s.ring_cache and not s.rope_at_write:
            raise ValueError(
                "ring_cache=True needs rope_at_write=True: re-applying RoPE at read in slot order "
                "permutes the temporal positions of cached frames once the ring wraps "
                "(paper §4.1). Turn rope_at_write on or ring_cache off.")
        if s.rope_at_write != s.delta_rotation:
            raise ValueError(
                "rope_at_write and delta_rotation go together: keys cached after RoPE need the "
                "delta rotation at each reset, and without RoPE at write there is nothing to "
                f"rotate. Set both to {s.rope_at_write or s.delta_rotation}.")
        if s.fused_pre_attention and not s.rope_at_write:
            raise ValueError(
                "fused_pre_attention=True applies RoPE to keys at write: it needs "
                "rope_at_write=True (or set fused_pre_attention=False).")
        if s.fp8_kv and not self.numerics.fp8_attention:
            raise ValueError(
                "fp8_kv=True stores K/V for FP8 attention: set numerics.fp8_attention=True, "
                "or fp8_kv=False for a bf16 cache.")
        if c.window > c.reset_period:
            raise ValueError(
                f"cache.window {c.window} is longer than cache.reset_period {c.reset_period}: a "
                "key would be delta-rotated twice. Use a window <= the reset period.")
        if c.calibration_steps < 1:
            raise ValueError("cache.calibration_steps must be at least 1")
        if self.tp < 1 or self.tp > self.model.n_heads:
            raise ValueError(
                f"tp={self.tp} does not fit {self.model.name}'s {self.model.n_heads} heads: heads "
                f"are split whole, so use 1 <= tp <= {self.model.n_heads}.")
        mlp_blocks = self.model.mlp_hidden // self.model.mlp_align
        if self.tp > mlp_blocks:
            raise ValueError(f"tp={self.tp} exceeds the {mlp_blocks} MLP blocks of "
                             f"{self.model.mlp_align} channels")

    def replace(self, **kw) -> "EngineConfig":
        return dataclasses.replace(self, **kw)


def preset(name: str, **kw) -> EngineConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return EngineConfig(model=PRESETS[name], **kw)


def split_evenly(total: int, parts: int, rank: int) -> tuple[int, int]:
    """(offset, size) of `rank`'s share when `total` whole units go to `parts` ranks, the first
    total % parts ranks taking one more."""
    base, extra = divmod(total, parts)
    size = base + (rank < extra)
    offset = rank * base + min(rank, extra)
    return offset, size


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


_SCALARS = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}


def check_field_type(where: str, annotation: str, v) -> None:
    """A field read from a manifest against its annotation: int, float, bool, str, None
    where allowed, and tuples of those (JSON lists)."""
    kinds = [a.strip() for a in annotation.split("|")]
    if v is None:
        if "None" in kinds:
            return
        raise TypeError(f"{where}: expected {annotation}, got null")
    for kind in kinds:
        if kind.startswith("tuple[") and isinstance(v, (list, tuple)):
            inner = kind[len("tuple["):-1].split(",")[0].strip()
            for i, x in enumerate(v):
                check_field_type(f"{where}[{i}]", inner, x)
            return
        allowed = _SCALARS.get(kind)
        if allowed and isinstance(v, allowed) and not (kind != "bool" and isinstance(v, bool)):
            return
        if kind not in _SCALARS and not kind.startswith("tuple["):
            return  # a type this reader does not check (nested specs are checked as dicts)
    raise TypeError(f"{where}: expected {annotation}, got {type(v).__name__} {v!r}"[:200])


def from_dict_checked(cls, d: dict, where: str = "config"):
    if not isinstance(d, dict):
        raise TypeError(f"{where}: expected an object, got {type(d).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r}")
    kw = {}
    for f in dataclasses.fields(cls):
        if f.name not in d:
            continue
        v = d[f.name]
        if f.name in _NESTED.get(cls.__name__, {}):
            v = from_dict_checked(_NESTED[cls.__name__][f.name], v, f"{where}.{f.name}")
        else:
            check_field_type(f"{where}.{f.name}", str(f.type), v)
            if isinstance(v, list):
                v = tuple(v)
        kw[f.name] = v
    return cls(**kw)


_NESTED = {
    "EngineConfig": {"model": ModelSpec, "cache": CacheSpec, "schedule": Schedule,
                     "switches": Switches, "numerics": Numerics},
    "ModelSpec": {"side": SideSpec},
}


def config_to_dict(cfg: EngineConfig) -> dict:
    return dataclasses.asdict(cfg)


def config_from_dict(d: dict) -> EngineConfig:
    """Inverse of config_to_dict; validates like any construction."""
    return from_dict_checked(EngineConfig, d)
