"""The audio encoder: 16 kHz mono speech -> `audio_tokens` features per AR step.

Each step sees a fixed window of log-mel frames (`side.audio_context`) that ends where the
step's audio ends, so every step has one shape. A step covers 1 / steps_per_second seconds
(166.7 ms at 24 fps, 4 frames per latent); 16,000 / 6 samples is not whole, so step k covers
samples [round(k * sr / 6), round((k + 1) * sr / 6)).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .spec import ModelSpec

LOG_MEL_FLOOR = 1e-6  # added to the mel power before its log


def mel_filterbank(n_mels: int, n_fft: int, sr: int) -> torch.Tensor:
    """Triangular filters on the HTK mel scale, [n_mels, n_fft // 2 + 1]."""
    def mel(f):
        return 2595.0 * math.log10(1.0 + f / 700.0)

    pts = torch.linspace(mel(0.0), mel(sr / 2), n_mels + 2)
    hz = 700.0 * (10.0 ** (pts / 2595.0) - 1.0)
    bins = torch.linspace(0, sr / 2, n_fft // 2 + 1)
    lo, mid, hi = hz[:-2, None], hz[1:-1, None], hz[2:, None]
    return torch.clamp(torch.minimum((bins - lo) / (mid - lo), (hi - bins) / (hi - mid)), min=0)


def step_bounds(spec: ModelSpec, k: int) -> tuple[int, int]:
    sr, sps = spec.side.sample_rate, spec.steps_per_second
    return round(k * sr / sps), round((k + 1) * sr / sps)


def steps_for(spec: ModelSpec, n_samples: int) -> int:
    """AR steps needed to cover n_samples of audio (the last one padded with silence)."""
    return max(1, math.ceil(n_samples * spec.steps_per_second / spec.side.sample_rate - 1e-9))


def window_samples(spec: ModelSpec) -> int:
    s = spec.side
    return s.n_fft + s.hop * (s.audio_context - 1)


def step_window(spec: ModelSpec, audio: torch.Tensor, k: int) -> torch.Tensor:
    """The samples the encoder sees for step k: window_samples ending at the step's end,
    zero before the session's start and after the audio's end."""
    n = window_samples(spec)
    _, end = step_bounds(spec, k)
    start = end - n
    seg = audio[max(start, 0): end]
    return F.pad(seg, (max(0, -start), n - seg.shape[0] - max(0, -start)))


class AudioEncoder(torch.nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        s = spec.side
        self.spec = spec
        self.register_buffer("mel", mel_filterbank(s.n_mels, s.n_fft, s.sample_rate),
                             persistent=False)
        self.register_buffer("window", torch.hann_window(s.n_fft), persistent=False)
        self.conv1 = torch.nn.Conv1d(s.n_mels, s.audio_width, 3, padding=1)
        self.conv2 = torch.nn.Conv1d(s.audio_width, s.audio_width, 3, stride=2, padding=1)
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(s.audio_width, s.audio_heads, 4 * s.audio_width,
                                             dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(s.audio_layers))
        self.out = torch.nn.Linear(s.audio_width, spec.audio_dim)

    def log_mel(self, samples: torch.Tensor) -> torch.Tensor:
        s = self.spec.side
        spec = torch.stft(samples, s.n_fft, s.hop, window=self.window, center=False,
                          return_complex=True).abs().pow(2)
        return torch.log(self.mel @ spec + LOG_MEL_FLOOR)  # [n_mels, audio_context]

    def forward(self, window: torch.Tensor) -> torch.Tensor:
        """One step's sample window [window_samples] -> features [audio_tokens, audio_dim]."""
        return self.features(self.log_mel(window.float())[None])[0]

    def features(self, log_mel: torch.Tensor) -> torch.Tensor:
        """Log-mels [B, n_mels, audio_context] -> features [B, audio_tokens, audio_dim]."""
        x = F.gelu(self.conv2(F.gelu(self.conv1(log_mel)))).transpose(1, 2)
        for layer in self.layers:
            x = layer(x)
        x = F.adaptive_avg_pool1d(x.transpose(1, 2), self.spec.audio_tokens).transpose(1, 2)
        return self.out(x)
