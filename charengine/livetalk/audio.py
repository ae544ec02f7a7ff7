"""LiveTalk's audio features: wav2vec2 (transformers' Wav2Vec2Model) run the OmniAvatar way, and
the live window each chunk's features are computed from.

The offline path (`AudioEncoder.features`, `whole_clip_features`) is OmniAvatar's: the speech is
normalized to zero mean and unit variance, the CNN turns it into 50 frames a second, those are
linearly interpolated (align_corners) onto the clip's N video frames, and only then do the
feature projection and the transformer run, at 16 positions a second. A video frame's features
are the transformer's last state and all its hidden states side by side ((layers + 2) x hidden:
14 x 768 = 10752 for wav2vec2-base). The first frame's row is repeated three more times so that
4 rows fold into each latent frame (AudioPack, part of the DiT).

Every stage but the CNN's later layers looks at the whole input: the normalization, the first
conv layer's GroupNorm (one group per channel, over time), the positional conv (128 positions,
8 s at the video rate) and the attention. So the offline features of a frame depend on the whole
clip, future included. The live path runs the same network on a fixed window that ends
`lookahead_frames` after the chunk's last frame: before sample 0 and past the clip's end the
window is padding, masked out of every one of those stages, so that a window holding the whole
clip gives the offline features exactly (`chunk_features(..., clip=...)`). Without `clip` (the
live case) video frame j reads the CNN frame centred on its time j / fps. The offline mapping
instead spreads the clip's N frames over its T CNN frames (j (T - 1) / (N - 1)): on time at the
clip's middle, 12.5 ms late at its start and 12.5 to 32.5 ms early at its end, so no fixed
mapping gives it for every clip length. (The input normalization hardly matters: the first
conv has no bias and its GroupNorm removes any offset and scale of the input.)

Chunks (three latent frames): chunk 0 plays video frames 0..8 and its rows are
[f0, f0, f0, f0, f1, ..., f8]; chunk k >= 1 plays frames 9 + 12 (k - 1) .. 9 + 12 k - 1, one
row each. Frame j plays speech samples [spf j, spf (j + 1)), spf = sample_rate / fps."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..checkpoint import CheckpointError

FIRST_CHUNK_FRAMES = 9  # video frames chunk 0 plays: the VAE's first latent decodes to one
CHUNK_FRAMES = 12  # video frames every later chunk plays (3 latent frames x 4)
CHUNK_ROWS = 12  # feature rows per chunk (chunk 0: its first frame four times, then 8 more)
REPEAT_FIRST = CHUNK_ROWS - FIRST_CHUNK_FRAMES  # extra copies of frame 0's row
NORM_EPS = 1e-7  # Wav2Vec2FeatureExtractor's variance epsilon


@dataclass(frozen=True)
class AudioSpec:
    """wav2vec2's shapes and the live window around a chunk.

    context_frames: video frames of speech before a chunk's first frame that the encoder sees;
    lookahead_frames: video frames of speech after its last frame, waited for before the chunk
    is encoded (so part of the latency: lookahead_frames / fps seconds)."""

    name: str = "wav2vec2-base-960h"
    sample_rate: int = 16000
    fps: int = 16
    hidden: int = 768
    layers: int = 12
    heads: int = 12
    intermediate: int = 3072
    conv_dim: tuple[int, ...] = (512,) * 7
    conv_kernel: tuple[int, ...] = (10, 3, 3, 3, 3, 2, 2)
    conv_stride: tuple[int, ...] = (5, 2, 2, 2, 2, 2, 2)
    pos_conv_kernel: int = 128
    pos_conv_groups: int = 16
    context_frames: int = 64
    lookahead_frames: int = 4

    def __post_init__(self):
        for f in ("conv_dim", "conv_kernel", "conv_stride"):
            object.__setattr__(self, f, tuple(int(v) for v in getattr(self, f)))
        if not len(self.conv_dim) == len(self.conv_kernel) == len(self.conv_stride):
            raise ValueError(f"{self.name}: conv_dim, conv_kernel and conv_stride differ in length")
        if self.sample_rate % self.fps:
            raise ValueError(f"{self.name}: sample_rate {self.sample_rate} is not a whole number "
                             f"of samples per frame at {self.fps} fps")
        if self.hidden % self.heads or self.hidden % self.pos_conv_groups:
            raise ValueError(f"{self.name}: hidden {self.hidden} is not a multiple of heads "
                             f"({self.heads}) and pos_conv_groups ({self.pos_conv_groups})")
        if self.context_frames < 0 or self.lookahead_frames < 0:
            raise ValueError(f"{self.name}: context and lookahead cannot be negative")

    @property
    def feature_dim(self) -> int:
        """Per video frame: the last state and the layers + 1 hidden states."""
        return (self.layers + 2) * self.hidden

    @property
    def samples_per_frame(self) -> int:
        return self.sample_rate // self.fps

    @property
    def cnn_stride(self) -> int:
        """Samples between CNN frames (320: 50 frames a second)."""
        return math.prod(self.conv_stride)

    @property
    def cnn_field(self) -> int:
        """Samples one CNN frame sees (400 for wav2vec2-base)."""
        field, jump = 1, 1
        for k, s in zip(self.conv_kernel, self.conv_stride):
            field, jump = field + (k - 1) * jump, jump * s
        return field

    @property
    def window_frames(self) -> int:
        """Encoder positions per chunk (one per video frame of the window)."""
        return self.context_frames + CHUNK_FRAMES + self.lookahead_frames

    def cnn_frames(self, n: int) -> int:
        """CNN frames of n samples (0 when n is shorter than one frame's field)."""
        return max(0, (n - self.cnn_field) // self.cnn_stride + 1)


# The released wav2vec2-base-960h. The default window is 80 frames (5 s): LiveTalk trained on
# clips of 81 video frames, so the encoder sees about the span of audio it saw in training; 4 s
# of it is context (also the positional conv's reach). With random weights the window's rows
# differ from the whole clip's about as much as a shorter clip's offline rows differ from a
# longer one's (random attention is nearly uniform, so this bounds the real model's
# difference from above; docs/DECISIONS.md, "LiveTalk"); lookahead barely moves it, and 4
# frames of it leave room for the mouth's lead over the sound.
BASE_960H = AudioSpec()
# CPU size; the CNN keeps wav2vec2-base's kernels and strides (320-sample stride, 400-sample
# field), so frame timing is identical.
TINY = AudioSpec(name="tiny-wav2vec2", hidden=32, layers=2, heads=2, intermediate=64,
                 conv_dim=(32,) * 7, context_frames=16, lookahead_frames=4)


# ---- the network ------------------------------------------------------------------------
def wav2vec_config(spec: AudioSpec):
    """transformers' Wav2Vec2Config with the spec's shapes (the rest as wav2vec2-base-960h)."""
    from transformers import Wav2Vec2Config

    return Wav2Vec2Config(
        hidden_size=spec.hidden, num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads, intermediate_size=spec.intermediate,
        conv_dim=spec.conv_dim, conv_kernel=spec.conv_kernel, conv_stride=spec.conv_stride,
        num_feat_extract_layers=len(spec.conv_dim), conv_bias=False, feat_extract_norm="group",
        do_stable_layer_norm=False, num_conv_pos_embeddings=spec.pos_conv_kernel,
        num_conv_pos_embedding_groups=spec.pos_conv_groups)


def _config_mismatch(spec: AudioSpec, cfg) -> str | None:
    """The first way a Wav2Vec2Config differs from the spec's shapes, or None."""
    want = {"hidden_size": spec.hidden, "num_hidden_layers": spec.layers,
            "num_attention_heads": spec.heads, "intermediate_size": spec.intermediate,
            "conv_dim": spec.conv_dim, "conv_kernel": spec.conv_kernel,
            "conv_stride": spec.conv_stride, "num_conv_pos_embeddings": spec.pos_conv_kernel,
            "num_conv_pos_embedding_groups": spec.pos_conv_groups,
            "feat_extract_norm": "group", "do_stable_layer_norm": False}
    for key, v in want.items():
        got = getattr(cfg, key, None)
        got = tuple(got) if isinstance(got, list) else got
        if got != v:
            return f"{key} is {got!r}, {spec.name} needs {v!r}"
    return None


def random_wav2vec_state(spec: AudioSpec, seed: int) -> dict[str, torch.Tensor]:
    """transformers' initialization of a Wav2Vec2Model of the spec's shapes, from `seed`."""
    from transformers import Wav2Vec2Model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Wav2Vec2Model(wav2vec_config(spec)).state_dict()


class AudioEncoder(torch.nn.Module):
    """wav2vec2 as LiveTalk runs it. `model` is charengine's `wav2vec2.Wav2Vec2` by default, or
    transformers' Wav2Vec2Model (`from_pretrained`; the plain path): the same state_dict keys
    `model.*` and the same features. `seed`: transformers' random initialization (None: the
    tensors are left for a state to fill, as the runtime loads one, and transformers is not
    imported). `normalize` is the feature extractor's do_normalize. Always in eval mode: the
    features are never trained here."""

    def __init__(self, spec: AudioSpec, seed: int | None = 0, model=None, normalize: bool = True):
        super().__init__()
        self.spec, self.normalize = spec, normalize
        if model is None:
            from .wav2vec2 import Wav2Vec2

            if seed is None:
                with torch.random.fork_rng(devices=[]):  # torch's own init: the global
                    model = Wav2Vec2(spec)                # generator left as it was
            else:
                with torch.device("meta"):
                    model = Wav2Vec2(spec)
                model.load_state_dict(random_wav2vec_state(spec, seed), assign=True)
        self.model = model
        self.eval()

    def train(self, mode: bool = True):
        return super().train(False)

    @classmethod
    def from_pretrained(cls, path, spec: AudioSpec) -> AudioEncoder:
        """A local transformers directory (config.json, the weights, preprocessor_config.json);
        a missing directory or shapes other than the spec's are one CheckpointError line."""
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(f"{path}: no such wav2vec2 directory")
        for f in ("config.json", "preprocessor_config.json"):
            if not (path / f).is_file():
                raise CheckpointError(f"{path}: no {f} (a transformers Wav2Vec2 directory with "
                                      "its feature extractor's config)")
        from transformers import Wav2Vec2Config, Wav2Vec2FeatureExtractor, Wav2Vec2Model

        try:
            cfg = Wav2Vec2Config.from_pretrained(str(path), local_files_only=True)
            fx = Wav2Vec2FeatureExtractor.from_pretrained(str(path), local_files_only=True)
        except Exception as e:  # transformers' own errors: one line with the cause
            raise CheckpointError(f"{path}: unreadable wav2vec2 config "
                                  f"({_one_line(e)})") from None
        bad = _config_mismatch(spec, cfg)
        if bad is None and (fx.sampling_rate != spec.sample_rate or fx.feature_size != 1):
            bad = (f"the feature extractor takes {fx.feature_size} channel(s) at "
                   f"{fx.sampling_rate} Hz, {spec.name} needs 1 at {spec.sample_rate} Hz")
        if bad:
            raise CheckpointError(f"{path}: wav2vec2 config does not match: {bad}")
        try:
            model = Wav2Vec2Model.from_pretrained(str(path), local_files_only=True)
        except Exception as e:
            raise CheckpointError(f"{path}: unreadable wav2vec2 weights ({_one_line(e)})") from None
        return cls(spec, model=model, normalize=bool(fx.do_normalize))

    def transformers_model(self):
        """transformers' Wav2Vec2Model over this encoder's weights (the plain path; a copy
        unless the encoder already runs one)."""
        from transformers import Wav2Vec2Model

        if isinstance(self.model, Wav2Vec2Model):
            return self.model
        p = next(self.model.parameters())
        with torch.device("meta"):
            model = Wav2Vec2Model(wav2vec_config(self.spec))
        model.load_state_dict({k: v.detach().clone() for k, v in self.model.state_dict().items()},
                              assign=True)
        return model.to(p.device).eval()

    def save_pretrained(self, path) -> None:
        """A directory `from_pretrained` reads: the model and its feature extractor's config."""
        from transformers import Wav2Vec2FeatureExtractor

        self.transformers_model().save_pretrained(str(path))
        Wav2Vec2FeatureExtractor(sampling_rate=self.spec.sample_rate,
                                 do_normalize=self.normalize).save_pretrained(str(path))

    # ---- stages -------------------------------------------------------------------------
    def _normalized(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """The feature extractor's zero mean, unit variance (over `valid` samples only), in
        float32 as it gives them (the model's dtype is applied after)."""
        if not self.normalize:
            return x.float()
        x64 = x.double()
        if valid is None:
            mean, var = x64.mean(-1, keepdim=True), x64.var(-1, unbiased=False, keepdim=True)
        else:
            m, n = valid.double(), valid.sum(-1, keepdim=True)
            mean = (x64 * m).sum(-1, keepdim=True) / n
            var = (((x64 - mean) * m) ** 2).sum(-1, keepdim=True) / n
        return ((x64 - mean) / torch.sqrt(var + NORM_EPS)).float()

    def _cnn(self, x: torch.Tensor, n_valid: int) -> torch.Tensor:
        """[B, S] -> [B, T, C]; the first layer's GroupNorm over the CNN frames that lie in the
        first n_valid samples only (what running the CNN on those samples alone gives)."""
        spec = self.spec
        layers = self.model.feature_extractor.conv_layers
        first, norm = layers[0], layers[0].layer_norm
        h = first.conv(x[:, None])
        v0 = (n_valid - spec.conv_kernel[0]) // spec.conv_stride[0] + 1
        m = (torch.arange(h.shape[-1], device=h.device) < v0).float()
        h32 = h.float()  # GroupNorm's statistics are float32 whatever the dtype
        mean = (h32 * m).sum(-1, keepdim=True) / v0
        var = (((h32 - mean) * m) ** 2).sum(-1, keepdim=True) / v0
        h32 = (h32 - mean) * torch.rsqrt(var + norm.eps)
        h = first.activation((h32 * norm.weight.float()[:, None]
                              + norm.bias.float()[:, None]).to(h.dtype))
        for layer in layers[1:]:
            h = layer(h)
        return h.transpose(1, 2)

    def _transformer(self, h: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
        """Projection and encoder on [B, F, C] CNN rows -> [B, F, feature_dim]: the last state
        then every hidden state (the embedding, each layer's output). Positions not `real` are
        zeroed before the positional conv and masked out of attention, as transformers does
        with an attention mask."""
        h, _ = self.model.feature_projection(h)
        enc = self.model.encoder
        bias = None
        if real is not None:
            h = h * real[..., None].to(h.dtype)
            bias = (~real)[:, None, None, :].to(h.dtype) * torch.finfo(h.dtype).min
        h = h + enc.pos_conv_embed(h)
        h = enc.dropout(enc.layer_norm(h))
        states = [h]
        for layer in enc.layers:
            out = layer(h, attention_mask=bias)
            h = out[0] if isinstance(out, tuple) else out
            states.append(h)
        return torch.cat([h, *states], dim=-1)

    # ---- the offline path ---------------------------------------------------------------
    def features(self, samples: torch.Tensor, frames: int) -> torch.Tensor:
        """OmniAvatar's features of a whole clip: samples [n] (float, at sample_rate) ->
        [frames, feature_dim], the CNN frames interpolated (align_corners) onto `frames`."""
        if samples.ndim != 1:
            raise ValueError(f"features takes one clip [n], got shape {list(samples.shape)}")
        if self.spec.cnn_frames(samples.numel()) < 1:
            raise ValueError(f"{samples.numel()} samples are shorter than one CNN frame "
                             f"({self.spec.cnn_field})")
        dtype = next(self.parameters()).dtype
        with torch.no_grad():
            x = self._normalized(samples[None]).to(dtype)
            h = self.model.feature_extractor(x).transpose(1, 2)
            h = F.interpolate(h.transpose(1, 2), size=frames, mode="linear",
                              align_corners=True).transpose(1, 2)
            return self._transformer(h)[0]

    # ---- the window path ----------------------------------------------------------------
    def window_features(self, x: torch.Tensor, n_valid: int, positions: torch.Tensor,
                        n_real: int) -> torch.Tensor:
        """Features of a window whose audio is its first n_valid samples (zeros after):
        x [S] -> [F, feature_dim]. positions [F] are CNN-frame coordinates (float32) of the F
        encoder positions, the first n_real of them real (the rest padding)."""
        t_valid = self.spec.cnn_frames(n_valid)
        if t_valid < 1:
            raise ValueError(f"a window of {n_valid} samples is shorter than one CNN frame")
        dtype = next(self.parameters()).dtype
        with torch.no_grad():
            m = torch.arange(x.numel(), device=x.device) < n_valid
            xs = (self._normalized(x[None], m[None]) * m).to(dtype)
            h = self._cnn(xs, n_valid)
            h = _lerp_rows(h, positions.to(h.device), t_valid)
            real = torch.arange(positions.numel(), device=h.device) < n_real
            return self._transformer(h, real[None])[0]


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__


def _lerp_rows(h: torch.Tensor, p: torch.Tensor, t_valid: int) -> torch.Tensor:
    """Rows of h [B, T, C] at fractional CNN positions p [F], clamped to the first t_valid rows;
    the weights as torch's linear interpolation forms them."""
    p = p.clamp(0, t_valid - 1)
    lo = p.floor().long().clamp(max=t_valid - 1)
    hi = (lo + 1).clamp(max=t_valid - 1)
    w = (p - lo.to(p.dtype)).clamp(0, 1)[:, None]
    return (h[:, lo].float() * (1 - w) + h[:, hi].float() * w).to(h.dtype)


# ---- chunks and the live window ---------------------------------------------------------
@dataclass(frozen=True)
class Clip:
    """A whole clip as the offline path sees it: N video frames over its first `samples`
    speech samples (at most (N - 1) / fps seconds: the offline path trims to that)."""

    frames: int
    samples: int

    @classmethod
    def of(cls, spec: AudioSpec, n_samples: int, latent_frames: int) -> Clip:
        n = 4 * latent_frames - 3
        return cls(n, min(n_samples, (n - 1) * spec.samples_per_frame))


@dataclass(frozen=True)
class WindowBounds:
    """What the encoder sees for a chunk: speech samples [a, b) (a >= 0) at video frames
    [first_frame, end_frame), b = end_frame * spf being the chunk's end plus the lookahead."""

    a: int
    b: int
    first_frame: int
    end_frame: int


def chunk_frames(k: int) -> tuple[int, int]:
    """Video frames [first, end) chunk k plays: (0, 9), then 12 a chunk."""
    if k < 0:
        raise ValueError(f"chunk {k}: chunks count from 0")
    if k == 0:
        return 0, FIRST_CHUNK_FRAMES
    first = FIRST_CHUNK_FRAMES + CHUNK_FRAMES * (k - 1)
    return first, first + CHUNK_FRAMES


def chunk_samples(spec: AudioSpec, k: int) -> tuple[int, int]:
    """Speech samples [a, b) that chunk k's frames play."""
    f0, f1 = chunk_frames(k)
    return f0 * spec.samples_per_frame, f1 * spec.samples_per_frame


def steps_for(spec: AudioSpec, n_samples: int) -> int:
    """Chunks needed to play n speech samples (at least one)."""
    frames = -(-n_samples // spec.samples_per_frame)
    if frames <= FIRST_CHUNK_FRAMES:
        return 1
    return 1 + -(-(frames - FIRST_CHUNK_FRAMES) // CHUNK_FRAMES)


def window_samples(spec: AudioSpec) -> int:
    """The encoder window's fixed length in samples (window_frames video frames)."""
    return spec.window_frames * spec.samples_per_frame


def window_bounds(spec: AudioSpec, k: int) -> WindowBounds:
    """Chunk k's window: it ends lookahead_frames after the chunk's last frame and reaches
    window_frames back (context_frames before a 12-frame chunk; chunk 0 has 3 frames more),
    clipped at sample 0."""
    _, f1 = chunk_frames(k)
    end = f1 + spec.lookahead_frames
    first = max(0, end - spec.window_frames)
    spf = spec.samples_per_frame
    return WindowBounds(first * spf, end * spf, first, end)


def chunk_window(spec: AudioSpec, speech: torch.Tensor, k: int) -> torch.Tensor:
    """Chunk k's encoder input from a whole-clip speech tensor [n]: the window_samples(spec)
    samples that end at the window's end (right-aligned, as a live session's history buffer
    holds them), zeros before sample 0 and past the speech's end."""
    w = window_bounds(spec, k)
    start = w.b - window_samples(spec)
    got = speech[max(0, start):min(w.b, speech.numel())]
    front = max(0, -start)
    return F.pad(got, (front, window_samples(spec) - front - got.numel()))


def chunk_features(spec: AudioSpec, encoder: AudioEncoder, window: torch.Tensor, k: int,
                   clip: Clip | None = None) -> torch.Tensor:
    """Chunk k's feature rows [12, feature_dim] from its window (`chunk_window`'s layout).

    Live (`clip` None): every window sample from sample 0 on is speech (silence is zeros), and
    frame j reads the CNN frame centred on its time j / fps. With `clip`, the offline path for
    that clip: samples past clip.samples and frames past clip.frames are padding, and frame j
    reads the CNN where align_corners puts it (j (T - 1) / (N - 1) of the clip's T CNN
    frames); a window holding the whole clip then gives `whole_clip_features`' rows for the
    chunk. Either way only speech before the window's end (the chunk's end plus the lookahead)
    is read."""
    w = window_bounds(spec, k)
    size = window_samples(spec)
    if window.shape != (size,):
        raise ValueError(f"chunk {k}: the window is {list(window.shape)}, expected [{size}]")
    front = size - (w.b - w.a)  # padding before sample 0, moved to the end
    x = torch.cat([window[front:], window.new_zeros(front)]) if front else window
    n_valid, end_frame = w.b - w.a, w.end_frame
    if clip is not None:
        n_valid = min(w.b, clip.samples) - w.a
        end_frame = min(end_frame, clip.frames)
    pos = window_positions(spec, w, clip)
    feats = encoder.window_features(x, n_valid, pos, end_frame - w.first_frame)
    f0, f1 = chunk_frames(k)
    rows = feats[f0 - w.first_frame:f1 - w.first_frame]
    if k == 0:
        rows = torch.cat([rows[:1].expand(REPEAT_FIRST, -1), rows])
    return rows


def window_positions(spec: AudioSpec, w: WindowBounds, clip: Clip | None) -> torch.Tensor:
    """CNN-frame coordinates (window-relative, float32) of the window's encoder positions.
    Live: the CNN frame centred on the video frame's time; with a clip: align_corners over it,
    in the float32 arithmetic torch's interpolation uses."""
    m = torch.arange(spec.window_frames, dtype=torch.float32)
    if clip is None:
        return (m * spec.samples_per_frame - spec.cnn_field / 2) / spec.cnn_stride
    scale = torch.tensor(spec.cnn_frames(clip.samples) - 1, dtype=torch.float32)
    scale = scale / max(clip.frames - 1, 1)
    return scale * (m + w.first_frame) - torch.tensor(w.a / spec.cnn_stride, dtype=torch.float32)


def whole_clip_features(spec: AudioSpec, encoder: AudioEncoder, speech: torch.Tensor,
                        latent_frames: int) -> torch.Tensor:
    """OmniAvatar's offline features of a clip of L latent frames: [4 L, feature_dim]. The clip
    has N = 4 L - 3 video frames; the speech is trimmed to (N - 1) / fps seconds (a shorter one
    is stretched over the N frames, as upstream does), and frame 0's row comes four times."""
    clip = Clip.of(spec, speech.numel(), latent_frames)
    feats = encoder.features(speech[:clip.samples], clip.frames)
    return torch.cat([feats[:1].expand(REPEAT_FIRST, -1), feats])

