"""The LiveTalk family's spec, cache geometry, schedule and switches, and its presets.

LiveTalk-1.3B is Wan 2.1 T2V-1.3B with OmniAvatar's audio conditioning, distilled to a
four-pass block-causal generator: chunks of three latent frames, one KV cache per block with
nine sink frames (the first three chunks) and a rolling window of the last two chunks.
Presets are data (`PRESETS`); `tiny-livetalk` has the same structure at CPU size."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .audio import BASE_960H, TINY as TINY_AUDIO, AudioSpec
from .vae import TINY as TINY_VAE, WAN21, VaeSpec


TEXT_ENCODERS = ("features", "tiny-umt5")


@dataclass(frozen=True)
class LiveTalkSpec:
    """Shapes of the LiveTalk DiT and its side networks; everything else is derived.

    A block: self-attention over the cache, cross-attention to the prompt, a GELU FFN, with
    AdaLN (shift, scale, gate) per latent frame from its timestep. Audio features are added
    before blocks 2 .. n_blocks // 2. Tokens are ordered (frame, row, column) over 2 x 2
    patches of the latent."""

    FAMILY = "livetalk"  # the model family (charengine/family.py); not a field
    NESTED = {"audio": AudioSpec, "vae": VaeSpec}  # read back as dataclasses; not a field

    name: str
    dim: int = 1536
    n_blocks: int = 30
    n_heads: int = 12
    ffn_dim: int = 8960
    text_dim: int = 4096  # umT5-XXL's width
    prompt_tokens: int = 512
    freq_dim: int = 256  # the timestep sinusoid's width
    latent_channels: int = 16
    patch: int = 2  # spatial patch (the temporal patch is 1)
    latent_h: int = 64
    latent_w: int = 64
    vae_stride: int = 8  # output pixels per latent pixel, each spatial axis
    vae_time_stride: int = 4  # video frames per latent frame after the first
    chunk_frames: int = 3  # latent frames denoised together (one step)
    sink_frames: int = 9  # latent frames kept for the session at the cache's start
    window_frames: int = 6  # latent frames of the rolling window (the last two chunks)
    fps: int = 16
    audio_hidden: int = 32  # AudioPack's output width
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # the prompt: "features" (the engine holds one prompt's umT5 features, made at build)
    # or "tiny-umt5" (a small umT5 encoder in the engine encodes any prompt)
    text_encoder: str = "features"
    audio: AudioSpec = field(default_factory=lambda: BASE_960H)
    vae: VaeSpec = field(default_factory=lambda: WAN21)

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ValueError(f"{self.name}: dim {self.dim} is not a multiple of n_heads")
        if self.latent_h % self.patch or self.latent_w % self.patch:
            raise ValueError(f"{self.name}: the latent is not a whole number of patches")
        if self.sink_frames % self.chunk_frames or self.window_frames % self.chunk_frames:
            raise ValueError(f"{self.name}: sink and window must be whole chunks")
        if self.text_encoder not in TEXT_ENCODERS:
            raise ValueError(f"{self.name}: text_encoder must be one of {TEXT_ENCODERS}")
        if any(d % 2 for d in self.rope_split):
            raise ValueError(f"{self.name}: head dim {self.head_dim} splits into odd RoPE "
                             f"parts {self.rope_split}")

    # ---- derived shapes --------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def rope_split(self) -> tuple[int, int, int]:
        """Temporal, height and width parts of a head (Wan: 44 / 42 / 42 of 128)."""
        third = self.head_dim // 3
        return self.head_dim - 2 * third, third, third

    @property
    def in_channels(self) -> int:
        """Noise, the reference latent and its mask channel."""
        return 2 * self.latent_channels + 1

    @property
    def grid_h(self) -> int:
        return self.latent_h // self.patch

    @property
    def grid_w(self) -> int:
        return self.latent_w // self.patch

    @property
    def frame_tokens(self) -> int:
        return self.grid_h * self.grid_w

    @property
    def chunk_tokens(self) -> int:
        return self.chunk_frames * self.frame_tokens

    @property
    def cache_frames(self) -> int:
        return self.sink_frames + self.window_frames

    @property
    def sink_chunks(self) -> int:
        return self.sink_frames // self.chunk_frames

    @property
    def window_chunks(self) -> int:
        return self.window_frames // self.chunk_frames

    @property
    def out_h(self) -> int:
        return self.latent_h * self.vae_stride

    @property
    def out_w(self) -> int:
        return self.latent_w * self.vae_stride

    @property
    def frames_per_latent(self) -> int:
        """Video frames per step (a chunk) once the first is done (delivery reads this)."""
        return self.chunk_frames * self.vae_time_stride

    @property
    def first_step_frames(self) -> int:
        """The first chunk's frames: the VAE's first latent decodes to one frame."""
        return 1 + (self.chunk_frames - 1) * self.vae_time_stride

    @property
    def audio_rows(self) -> int:
        """Audio feature rows per chunk (AudioPack folds vae_time_stride rows per frame)."""
        return self.chunk_frames * self.vae_time_stride

    @property
    def audio_dim(self) -> int:
        return self.audio.feature_dim

    @property
    def audio_blocks(self) -> range:
        """Blocks that audio is added before (2 .. n_blocks // 2, one projection each)."""
        return range(2, self.n_blocks // 2 + 1)

    @property
    def side(self) -> AudioSpec:
        """What delivery reads of the side networks (the speech's sample rate)."""
        return self.audio

    def check_tp(self, tp: int) -> None:
        if tp != 1:
            raise ValueError(f"{self.name} runs on one GPU (tp = 1); its 1.3B parameters need "
                             "no tensor parallelism. Use the target's decoder placement to "
                             "spread the work instead.")

    def block_linear_params(self) -> int:
        """Parameters of one block's linears (self and cross attention, FFN)."""
        return 8 * self.dim * self.dim + 2 * self.dim * self.ffn_dim


@dataclass(frozen=True)
class LiveTalkCache:
    """The position reset and FP8 KV calibration of the per-block caches.

    Sink frames keep positions 0 .. sink_frames - 1 for the session. A window chunk c >= 3
    would sit at position 3c; with the reset, the chunk after the sink takes position
    sink_frames, and every `reset_period` chunks after the first window chunk the cached
    window keys rotate back by reset_period chunks (the delta rotation), so positions stay in
    [0, sink_frames + (reset_period + 1) * chunk_frames). The default, 3 chunks, keeps every
    position within the 21 latent frames LiveTalk was trained on (docs/DECISIONS.md)."""

    reset_period: int = 3  # chunks
    calibration_chunks: int = 4  # FP8 KV scales are set from the chunks before this one
    scale_margin: float = 1.5

    def __post_init__(self):
        if self.reset_period < 1:
            raise ValueError("cache.reset_period must be at least 1 chunk")
        if self.calibration_chunks < 1:
            raise ValueError("cache.calibration_chunks must be at least 1")


@dataclass(frozen=True)
class LiveTalkSchedule:
    """Four passes at a shift-warped flow-matching schedule, then the commit pass at t = 0.

    The model sees the timesteps rounded to bf16 (1000, 936, 832, 624); x0 and the
    re-noising use the exact sigmas (1, 0.9375, 0.8333, 0.625)."""

    steps: tuple[float, ...] = (1000.0, 750.0, 500.0, 250.0)
    shift: float = 5.0
    train_timesteps: int = 1000

    @property
    def passes(self) -> int:
        return len(self.steps)

    @property
    def sigmas(self) -> tuple[float, ...]:
        out = []
        for t in self.steps:
            s = t / self.train_timesteps
            out.append(self.shift * s / (1 + (self.shift - 1) * s))
        return tuple(out)

    @property
    def timesteps(self) -> tuple[float, ...]:
        """The timesteps the model is conditioned on (bf16-rounded, as the model saw)."""
        import torch

        exact = torch.tensor([s * self.train_timesteps for s in self.sigmas])
        return tuple(float(x) for x in exact.to(torch.bfloat16).float())

    def next_sigma(self, p: int) -> float:
        return self.sigmas[p + 1] if p + 1 < self.passes else 0.0


@dataclass(frozen=True)
class LiveTalkSwitches:
    """One switch per optimization of the LiveTalk step; all off is its plain path (the
    upstream loop's semantics, sessions of any length aside)."""

    baked_adaln: bool = True  # AdaLN and head modulation tables per pass, not the time MLP
    text_kv_once: bool = True  # cross-attention K/V from the prompt at session start
    ring_cache: bool = True  # window chunks in a ring at a device-side write position
    rope_tables: bool = True  # RoPE from fp32 cos/sin tables on the device, not complex64/128
    position_reset: bool = True  # bounded positions: periodic reset with the delta rotation
    fp8_kv: bool = True  # K/V stored FP8 with per-(block, head) scales calibrated once
    # q, k and v as one GEMM over their concatenated weights (and scales)
    fused_qkv: bool = True
    # the block linears' per-token FP8 quantization in fused kernels: AdaLN + quantize before
    # q/k/v (one quantization for the three) and the FFN (with the cross-attention's
    # residual add), quantize alone before the others
    fused_act_quant: bool = True
    # the FP8 linears' bias added in the GEMM's epilogue (one rounding), not after it
    gemm_bias: bool = True
    # with the FP8 cache in use: the q/k norm across heads, RoPE, the queries' quantization and
    # the K/V quantization and ring write in one kernel (plugins/pre_attention_width.py)
    fused_pre_attention: bool = True
    # with fused_act_quant: each gated residual add (and the audio add before a block) inside
    # the quantizing norm that follows it: the cross-attention's layer norm, the next
    # block's AdaLN
    fused_residual: bool = True
    fused_gelu_quant: bool = True  # the FFN's GELU and its per-token quantization, one kernel
    fused_q_norm: bool = True  # the cross-attention's q RMS norm in one kernel, not six ops
    skip_commit_tail: bool = True  # the commit pass stops after the last block's K/V
    # with the ring cache: the chunks before the steady one (those that fill the cache, and
    # the FP8 calibration's) replay CUDA graphs too, one per chunk, not eager launches: a
    # session's first frames and the deadlines its first steps set come at graph speed
    graph_fill_chunks: bool = True
    # with fp8_kv: the cache the calibration chunks write in the model's dtype holds only
    # their slots, and lies in the FP8 cache's buffers (replaced block by block at the
    # calibration), not beside them
    shared_kv_stores: bool = True
    # the same fused pre-attention where the cache is in the model's dtype (the chunks before
    # the FP8 calibration, every chunk without fp8_kv): norm, RoPE and the K/V write in one
    # kernel, the queries given back unquantized for SDPA
    fused_wide_pre_attention: bool = True
    # with fp8_kv: the calibration's amax and quantization of each block's cache in two
    # kernels (plugins/calibrate.py), not a dozen PyTorch ops with fp32 temporaries
    fused_calibration: bool = True
    # with fp8_kv: the delta rotation of every block's FP8 window keys in one kernel
    # (plugins/delta_rotation.py), in place, not a block at a time through fp32 temporaries
    fused_delta_rotation: bool = True
    # with the FP8 attention kernel: its grid planned to fill the GPU's last round of tiles
    # (those tiles split over their keys, then merged: plugins/attention.SPLIT_TILES), not one
    # program per tile of 64 queries
    split_attention: bool = True
    # with the FP8 attention kernel: the Gluon kernel that computes the next key tile's scores
    # while this tile's softmax runs (plugins/kernels/attention_pipelined.py), not the Triton
    # kernel that waits for them
    pipelined_attention: bool = True
    # with FP8 attention and text_kv_once: the cross-attention in FP8 too, by the same kernel:
    # the prompt's K/V quantized once a session (a scale per block and head), the queries'
    # RMS norm and per-head quantization one kernel (plugins/rms_norm.py); not SDPA in the
    # model's dtype
    fp8_cross_attention: bool = True
    # the patch embedding as one GEMM over the latent's patches (bias in its epilogue), its
    # tokens already rows [F * T, dim]; not a cuDNN Conv3d with its layout transforms, a bias
    # add and the copy that turns its channels-first output into rows
    patch_gemm: bool = True
    # the decoder's implementation where it runs on a GPU (on a CPU the plain modules run
    # whatever these say), chosen once when the side networks load (sidenets.SideNets.ready):
    # the frames layout (vae_blocks.use_frames_layout: channels-last activations, every 3-tap
    # conv a 2-D conv over its taps stacked on the channels, with vae_fused_norm the norm
    # before it writing those taps); off, cuDNN's 3-D convs over [C, T, H, W]
    vae_frames_layout: bool = True
    # with vae_frames_layout: the resizes and the residual blocks' ends as one kernel each
    # over the pixel rows (vae_blocks.use_row_kernels, plugins/pixel_rows.py); off, PyTorch's
    vae_row_kernels: bool = True
    # each RMS norm and the SiLU after it as one kernel (vae_blocks.use_fused_norms,
    # plugins/channel_norm.py); off, the unfused ops
    vae_fused_norm: bool = True
    # the audio encoder's chunks from the first whose window is whole (audio_graph.py) as one
    # CUDA graph where it runs on a GPU, captured at the side networks' warm-up; off, eager
    # launches (on a CPU the eager path runs whatever this says)
    audio_graph: bool = True
    # the audio encoder's weights and activations in bf16 where it runs on a GPU (its feature
    # normalization, its first GroupNorm's statistics and the rows' interpolation in fp32 as
    # on every path), chosen once when the side networks load (sidenets.side_dtypes); off,
    # fp32 as the checkpoint stores it. Its features reach the DiT in the model's dtype
    # either way; the error it adds is bounded in tests/test_livetalk_audio.py
    audio_bf16: bool = True

    # the DiT's switches in the waterfall's order; the decoder's (DECODER) are timed apart
    # (scripts/livetalk_decoder.py)
    ORDER = ("baked_adaln", "text_kv_once", "ring_cache", "rope_tables", "position_reset",
             "fp8_kv", "fused_qkv", "fused_act_quant", "gemm_bias", "fused_pre_attention",
             "fused_residual", "fused_gelu_quant", "fused_q_norm", "skip_commit_tail",
             "graph_fill_chunks", "shared_kv_stores", "fused_wide_pre_attention",
             "fused_calibration", "fused_delta_rotation", "split_attention",
             "pipelined_attention", "fp8_cross_attention", "patch_gemm")
    DECODER = ("vae_frames_layout", "vae_row_kernels", "vae_fused_norm")
    AUDIO = ("audio_graph", "audio_bf16")  # the audio encoder's (scripts/bench_sidenets.py)

    @classmethod
    def baseline(cls) -> "LiveTalkSwitches":
        return cls(**{f.name: False for f in dataclasses.fields(cls)})

    @classmethod
    def cumulative(cls, upto: str) -> "LiveTalkSwitches":
        if upto == "baseline":
            return cls.baseline()
        on = cls.ORDER[: cls.ORDER.index(upto) + 1]
        return cls(**{name: name in on for name in cls.ORDER})


LIVETALK_1_3B = LiveTalkSpec(name="livetalk-1.3b")
TINY = LiveTalkSpec(name="tiny-livetalk", dim=64, n_blocks=6, n_heads=2, ffn_dim=128,
                    text_dim=32, prompt_tokens=16, freq_dim=32, latent_h=8, latent_w=8,
                    audio_hidden=8, text_encoder="tiny-umt5", audio=TINY_AUDIO, vae=TINY_VAE)
PRESETS = {s.name: s for s in (LIVETALK_1_3B, TINY)}


# the benchmark scripts' arms: the preset as it is, the plain path in bf16, every switch with
# bf16 GEMMs and cache
ARMS = ("preset", "plain", "bf16")


def arm_config(cfg, arm: str):
    """cfg (an EngineConfig of this family) as the arm `arm` of ARMS runs it."""
    from ..config import Numerics

    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; known: {', '.join(ARMS)}")
    if arm == "preset":
        return cfg
    return cfg.replace(switches=LiveTalkSwitches.baseline() if arm == "plain" else
                       dataclasses.replace(LiveTalkSwitches(), fp8_kv=False),
                       numerics=Numerics(dtype="bfloat16", fp8_gemm=False, fp8_attention=False))


# the waterfall's arms (scripts/bench_waterfall.py, through arms.py): the plain path in bf16 without FP8,
# then each switch of LiveTalkSwitches.ORDER on in turn, FP8 GEMMs (promoted sums) turned on
# right before the FP8 cache (which turns FP8 attention on with it: the cache needs it), and
# last the preset as it is (fast accumulation with it)
WATERFALL_PLAIN, WATERFALL_FP8_GEMM, WATERFALL_PRODUCTION = "plain", "fp8_gemm", "production"
FP8_CACHE = "fp8_kv"  # the switch that FP8 attention comes on with


def waterfall_arms() -> tuple[str, ...]:
    """The waterfall's arms in order, from the switches' ORDER as it is now."""
    order = LiveTalkSwitches.ORDER
    at = order.index(FP8_CACHE) if FP8_CACHE in order else len(order)
    return (WATERFALL_PLAIN, *order[:at], WATERFALL_FP8_GEMM, *order[at:], WATERFALL_PRODUCTION)


def waterfall_config(cfg, arm: str):
    """cfg (an EngineConfig of this family) as waterfall arm `arm` runs it: every switch up
    to `arm` on, FP8 GEMMs from WATERFALL_FP8_GEMM on, FP8 attention with FP8_CACHE, sums
    promoted; the production arm is cfg itself."""
    arms = waterfall_arms()
    if arm not in arms:
        raise ValueError(f"unknown waterfall arm {arm!r}; known: {', '.join(arms)}")
    if arm == WATERFALL_PRODUCTION:
        return cfg
    on = set(arms[1: arms.index(arm) + 1])
    switches = dataclasses.replace(LiveTalkSwitches.baseline(),
                                   **{n: n in on for n in LiveTalkSwitches.ORDER})
    numerics = dataclasses.replace(cfg.numerics, fp8_gemm=WATERFALL_FP8_GEMM in on,
                                   fp8_attention=FP8_CACHE in on, fast_accum=False)
    return cfg.replace(switches=switches, numerics=numerics)
