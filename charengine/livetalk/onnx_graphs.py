"""LiveTalk's side networks as the graphs charbuild --export-onnx writes: the Wan 2.1 VAE's
streaming decoder, one chunk of latents per call, as two graphs (`decoder_first`: a session's
first chunk, whose first latent decodes to one frame; `decoder`: every later chunk), every
temporal conv's past input frames as explicit inputs and outputs; and wav2vec2's live window,
one chunk's window and the chunk's index in, the chunk's feature rows out.

The audio graph is `audio.chunk_features` (the live path) with the chunk index a tensor: where
the window is clipped at sample 0 (the first chunks), how much of it is speech, which
positions are real and which rows the chunk takes are computed from it in the graph, so one
graph of fixed shapes serves every chunk. Its input normalization is float32 (the runtime's
is float64, which TensorRT does not run; the first conv's GroupNorm removes any offset and
scale of its input, so the features hardly differ)."""

from __future__ import annotations

import torch

from ..family import PAST, PRESENT, OnnxGraph
from .audio import (CHUNK_FRAMES, CHUNK_ROWS, FIRST_CHUNK_FRAMES, NORM_EPS, REPEAT_FIRST,
                    AudioEncoder, window_bounds)
from .sidenets import SideNets
from .spec import LiveTalkSpec
from .vae import StreamingDecoder, WanVAE
from .vae_blocks import StreamState

CHECK_SEED = 0  # seeds the inputs the export is checked on
STEADY_CALLS = 2  # later chunks decoded in the check, after the first
SPEECH_SCALE = 0.1  # amplitude of the check's speech-like noise (full scale is 1)


def cache_convs(vae: WanVAE, spec: LiveTalkSpec) -> list[tuple[str, torch.nn.Module]]:
    """The temporal convs whose past frames a session carries, each with its path in the VAE,
    in call order (a dry run of a first and a later chunk finds them; which convs carry
    frames does not depend on the frame's size, so the run is of one latent pixel)."""
    names = {m: n for n, m in vae.named_modules()}
    dec = StreamingDecoder(vae)
    z = torch.zeros(spec.latent_channels, spec.chunk_frames, 1, 1)
    with torch.no_grad():
        dec(z)
        first = list(dec.state.past)
        dec(z)
    if list(dec.state.past) != first:
        raise ValueError("the VAE's first chunk and later chunks carry different convs")
    return [(names[m], m) for m in first]


class DecoderStep(torch.nn.Module):
    """One streaming decoder call: a chunk of normalized latents [z, F, h, w] (and, after a
    session's first chunk, every temporal conv's last two input frames) -> frames
    [n, 3, H, W] in [0, 1] and each conv's frames for the next call."""

    def __init__(self, vae: WanVAE, convs: list[torch.nn.Module], first: bool):
        super().__init__()
        self.vae, self.convs, self.first = vae, convs, first
        self.stream = StreamingDecoder(vae)

    def forward(self, latents: torch.Tensor, *past: torch.Tensor):
        state = self.stream.state = StreamState()
        if not self.first:
            state.started = True
            for conv, p in zip(self.convs, past):
                state.past[conv] = p.clone()
        frames = self.stream(latents)
        return (frames, *(state.past[conv] for conv in self.convs))


class AudioStep(torch.nn.Module):
    """`audio.chunk_features` of the live path with the chunk index a tensor: a chunk's window
    [window_samples] (right-aligned, zeros before sample 0) and chunk k (int64) -> its feature
    rows [12, feature_dim]."""

    def __init__(self, encoder: AudioEncoder):
        super().__init__()
        self.encoder = encoder
        self.a = a = encoder.spec
        m = torch.arange(a.window_frames, dtype=torch.float32)
        self.register_buffer("positions", (m * a.samples_per_frame - a.cnn_field / 2)
                             / a.cnn_stride, persistent=False)

    def forward(self, window: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
        a, enc = self.a, self.encoder
        size = a.window_frames * a.samples_per_frame
        # window_bounds(chunk): speech [first, end) frames, clipped at sample 0
        f1 = FIRST_CHUNK_FRAMES + CHUNK_FRAMES * chunk
        f0 = torch.clamp(f1 - CHUNK_FRAMES, min=0)
        end = f1 + a.lookahead_frames
        first = torch.clamp(end - a.window_frames, min=0)
        n_valid = (end - first) * a.samples_per_frame
        # the padding before sample 0 moved to the end, as chunk_features does
        i = torch.arange(size) + (size - n_valid)
        x = torch.where(i < size, window.float()[i.clamp(max=size - 1)], 0.0)
        valid = (torch.arange(size) < n_valid).float()
        if enc.normalize:
            n = n_valid.float()
            mean = (x * valid).sum() / n
            var = (((x - mean) * valid) ** 2).sum() / n
            x = (x - mean) / torch.sqrt(var + NORM_EPS)
        dtype = next(enc.parameters()).dtype
        h = enc._cnn((x * valid)[None].to(dtype), n_valid)
        # the CNN rows at the positions (audio._lerp_rows, clamped to the valid rows)
        t_valid = torch.clamp((n_valid - a.cnn_field) // a.cnn_stride + 1, min=1)
        p = torch.minimum(self.positions.clamp(min=0), (t_valid - 1).float())
        lo = torch.minimum(p.floor().long(), t_valid - 1)
        hi = torch.minimum(lo + 1, t_valid - 1)
        w = (p - lo.float()).clamp(0, 1)[:, None]
        h = (h[:, lo].float() * (1 - w) + h[:, hi].float() * w).to(h.dtype)
        real = torch.arange(a.window_frames) < end - first
        feats = enc._transformer(h, real[None])[0]
        j = torch.arange(CHUNK_ROWS)
        rows = f0 - first + torch.where(chunk == 0, torch.clamp(j - REPEAT_FIRST, min=0), j)
        return feats.index_select(0, rows)


def decoder_graphs(spec: LiveTalkSpec, side: SideNets) -> list[OnnxGraph]:
    convs = cache_convs(side.vae, spec)
    names, modules = [n for n, _ in convs], [m for _, m in convs]
    g = torch.Generator().manual_seed(CHECK_SEED)
    shape = (spec.latent_channels, spec.chunk_frames, spec.latent_h, spec.latent_w)
    latents = [torch.randn(shape, generator=g) for _ in range(1 + STEADY_CALLS)]
    first = DecoderStep(side.vae, modules, first=True).eval()
    with torch.no_grad():
        present = first(latents[0])[1:]
    past_in = tuple(PAST + n for n in names)
    outputs = ("frames", *(PRESENT + n for n in names))
    zs = f"[{', '.join(map(str, shape))}]"
    frames = f"[{{}}, 3, {spec.out_h}, {spec.out_w}] in [0, 1]"
    cache = ("present.* are each temporal conv's last two input frames after this call, fed "
             "as past.* to the next chunk's call")
    return [
        OnnxGraph("decoder_first", first, ("latents",), outputs, [{"latents": latents[0]}],
                  doc=f"a session's first chunk of normalized latents {zs} -> "
                  f"{frames.format(spec.first_step_frames)}; {cache}"),
        OnnxGraph("decoder", DecoderStep(side.vae, modules, first=False).eval(),
                  ("latents", *past_in), outputs,
                  [{"latents": latents[1], **dict(zip(past_in, present))}]
                  + [{"latents": z} for z in latents[2:]],
                  {PRESENT + n: PAST + n for n in names},
                  doc=f"every later chunk: normalized latents {zs} and past.* -> "
                  f"{frames.format(spec.frames_per_latent)}; {cache}")]


def audio_graph(spec: LiveTalkSpec, side: SideNets) -> OnnxGraph:
    from . import FAMILY

    a = spec.audio
    full = next(k for k in range(1, a.window_frames) if window_bounds(a, k).first_frame > 0)
    chunks = sorted({0, 1, full, full + 1})  # clipped windows, then full ones
    g = torch.Generator().manual_seed(CHECK_SEED)
    speech = torch.randn(window_bounds(a, chunks[-1]).b, generator=g) * SPEECH_SCALE
    calls = [{"window": FAMILY.audio_window(spec, speech, k), "chunk": torch.tensor(k)}
             for k in chunks]
    return OnnxGraph(
        "audio_encoder", AudioStep(side.audio_encoder).eval(), ("window", "chunk"),
        ("features",), calls,
        doc=f"chunk k's speech window [{FAMILY.window_samples(spec)}] ({a.sample_rate} Hz "
        f"mono, ending {a.lookahead_frames} frames after the chunk's last frame, zeros before "
        f"sample 0) and k (int64) -> the chunk's feature rows [{CHUNK_ROWS}, {a.feature_dim}]")


def onnx_graphs(spec: LiveTalkSpec, side: SideNets) -> list[OnnxGraph]:
    return [*decoder_graphs(spec, side), audio_graph(spec, side)]
