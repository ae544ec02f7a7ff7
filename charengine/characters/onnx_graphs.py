"""The characters family's side networks as the graphs charbuild --export-onnx writes: the
decoder's step (one latent in, its frames out, every causal conv's past input frames as
explicit inputs and outputs) and the audio encoder's step (one window of speech in, the step's
features out).

The audio encoder's log-mel spectrogram is computed in the graph as a strided 1-D conv with
the windowed DFT basis (the real and imaginary parts of torch.stft's onesided, uncentred
transform), not as ONNX's STFT, which TensorRT does not parse; the rest of each graph is the
module the runtime calls."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..family import PAST, PRESENT, OnnxGraph
from .audio import LOG_MEL_FLOOR, AudioEncoder
from .decoder import CausalConv3d, Decoder
from .sidenets import SideNets
from .spec import ModelSpec

CHECK_SEED = 0  # seeds the inputs the export is checked on
DECODER_CALLS = 3  # decoder calls checked: a session's first (zero caches) and two carried
AUDIO_CALLS = 3  # speech windows checked
SPEECH_SCALE = 0.1  # amplitude of the check's speech-like noise (full scale is 1)


def cache_convs(decoder: Decoder) -> list[tuple[str, CausalConv3d]]:
    """The decoder's causal convs, each with its path in the decoder, in call order."""
    return [(name, m) for name, m in decoder.named_modules() if isinstance(m, CausalConv3d)]


class DecoderStep(torch.nn.Module):
    """One decoder call of a session: latent [C, h, w] and every causal conv's last
    kt - 1 input frames (zeros at a session's start) -> frames [frames_per_latent, 3, H, W]
    in [0, 1] and each conv's frames for the next call."""

    def __init__(self, decoder: Decoder):
        super().__init__()
        self.decoder = decoder
        self.convs = [m for _, m in cache_convs(decoder)]

    def forward(self, latent: torch.Tensor, *past: torch.Tensor):
        for conv, p in zip(self.convs, past):
            conv.state = p
        frames = self.decoder(latent)
        present = [conv.state for conv in self.convs]
        self.decoder.reset()
        return (frames, *present)


class AudioStep(torch.nn.Module):
    """One audio encoder call: a step's window [window_samples] -> features [audio_tokens,
    audio_dim]; the power spectrum through the windowed DFT basis as one strided conv."""

    def __init__(self, encoder: AudioEncoder):
        super().__init__()
        side = encoder.spec.side
        self.encoder, self.hop = encoder, side.hop
        bins = side.n_fft // 2 + 1
        n = torch.arange(side.n_fft, dtype=torch.float64)
        f = torch.arange(bins, dtype=torch.float64)[:, None]
        angle = 2 * math.pi * f * n / side.n_fft
        window = encoder.window.double()
        basis = torch.cat([torch.cos(angle) * window, -torch.sin(angle) * window])
        self.register_buffer("basis", basis[:, None].float(), persistent=False)
        self.bins = bins

    def forward(self, window: torch.Tensor) -> torch.Tensor:
        x = F.conv1d(window.float()[None, None], self.basis, stride=self.hop)[0]
        power = x[:self.bins].square() + x[self.bins:].square()  # |stft|^2 [bins, frames]
        log_mel = torch.log(self.encoder.mel @ power + LOG_MEL_FLOOR)
        return self.encoder.features(log_mel[None])[0]


def decoder_graph(spec: ModelSpec, side: SideNets) -> OnnxGraph:
    decoder = side.decoder
    convs = cache_convs(decoder)
    g = torch.Generator().manual_seed(CHECK_SEED)
    latents = [torch.randn(spec.latent_channels, spec.latent_h, spec.latent_w, generator=g)
               for _ in range(DECODER_CALLS)]
    decoder.reset()
    with torch.no_grad():
        decoder(latents[0])
    past = [torch.zeros_like(m.state) for _, m in convs]
    decoder.reset()
    names = [n for n, _ in convs]
    first = {"latent": latents[0], **{PAST + n: p for n, p in zip(names, past)}}
    return OnnxGraph(
        "decoder", DecoderStep(decoder).eval(),
        ("latent", *(PAST + n for n in names)), ("frames", *(PRESENT + n for n in names)),
        [first] + [{"latent": z} for z in latents[1:]],
        {PRESENT + n: PAST + n for n in names},
        f"one latent [{spec.latent_channels}, {spec.latent_h}, {spec.latent_w}] -> its "
        f"{spec.frames_per_latent} frames [{spec.frames_per_latent}, 3, {spec.out_h}, "
        f"{spec.out_w}] in [0, 1]; past.* are each causal conv's last input frames (zeros at "
        "a session's start), present.* the same after this call, fed back as past.* at the "
        "next")


def audio_graph(spec: ModelSpec, side: SideNets) -> OnnxGraph:
    from . import FAMILY

    g = torch.Generator().manual_seed(CHECK_SEED)
    speech = torch.randn(round(AUDIO_CALLS * spec.side.sample_rate / spec.steps_per_second),
                         generator=g) * SPEECH_SCALE
    calls = [{"window": FAMILY.audio_window(spec, speech, k)} for k in range(AUDIO_CALLS)]
    n = FAMILY.window_samples(spec)
    return OnnxGraph(
        "audio_encoder", AudioStep(side.audio_encoder).eval(), ("window",), ("features",),
        calls, doc=f"one step's speech window [{n}] ({spec.side.sample_rate} Hz mono, ending "
        "at the step's last sample, zeros before the session's start) -> features "
        f"[{spec.audio_tokens}, {spec.audio_dim}]")


def onnx_graphs(spec: ModelSpec, side: SideNets) -> list[OnnxGraph]:
    return [decoder_graph(spec, side), audio_graph(spec, side)]
