"""The Wan 2.1 VAE's building blocks: causal 3-D convs, RMS norms, per-frame attention, the
2x resampling stages, and the encoder and decoder stacks built from them.

Module and parameter names are those of the released `Wan2.1_VAE.pth`, so its state dict loads
unchanged. Every 3-tap temporal conv is causal: an output frame sees its input frame and the two
before it, zeros before the first. Decoding a session in pieces keeps each conv's last two input
frames in a `StreamState`; a call without one is a whole sequence from the session's start. The
first frame of a sequence skips temporal resampling (it stays one frame, and the temporal convs
of the resamplers start at the second), which is why latent 0 decodes to one frame and each
later latent to four.

Two ways to run the convs, chosen once per module (`use_frames_layout`): as 3-D convs over
[B, C, T, H, W] (the plain path), or over activations kept channels-last
(`torch.channels_last_3d`: [B, T, H, W, C] in memory) as 2-D channels-last convs with the
frames as the batch, a causal 3-tap conv's taps stacked on its input channels (one GEMM of
3 C inputs per output pixel). The two give the same frames (up to the order of the sums).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import (bias_residual_rows, channel_norm_taps, channel_rms_norm, keep_past,
                   nearest2x_rows, stacked_taps)


class StreamState:
    """A decode session: the last input frames of every temporal conv (allocated on first use,
    then updated in place) and whether the session's first frame is done."""

    def __init__(self) -> None:
        self.past: dict[nn.Module, torch.Tensor] = {}
        self.started = False

    def reset(self) -> None:
        for t in self.past.values():
            t.zero_()
        self.started = False

    def history(self, conv: nn.Module, like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """`conv`'s past input frames, a tensor of `shape` in `like`'s dtype and device (zeros
        at a session's start)."""
        past = self.past.get(conv)
        if past is None or past.shape != shape or past.dtype != like.dtype \
                or past.device != like.device:
            past = self.past[conv] = like.new_zeros(shape)
        return past


def numbered(layers: dict[int, nn.Module]) -> nn.ModuleDict:
    """Layers under the numeric names the checkpoint gives them (positions with no weights,
    such as activations, are absent)."""
    return nn.ModuleDict({str(i): m for i, m in layers.items()})


FRAMES = torch.channels_last_3d  # the frames layout's memory format


def frames_of(x: torch.Tensor) -> torch.Tensor:
    """One sequence [1, C, T, H, W] in the frames layout as 2-D frames [T, C, H, W]
    (channels-last): a view."""
    if x.shape[0] != 1:
        raise ValueError(f"the frames layout decodes one sequence at a time, got {x.shape[0]}")
    return x.contiguous(memory_format=FRAMES)[0].transpose(0, 1)


def sequence_of(y: torch.Tensor) -> torch.Tensor:
    """Frames [T, C, H, W] (channels-last) as the sequence [1, C, T, H, W]: a view."""
    return y.transpose(0, 1)[None]


def rows_of(x: torch.Tensor) -> torch.Tensor:
    """One sequence [1, C, T, H, W] as its frames' pixel rows [T, H, W, C], contiguous (a view
    of a sequence in the frames layout)."""
    return frames_of(x).permute(0, 2, 3, 1)


def sequence_of_rows(rows: torch.Tensor) -> torch.Tensor:
    """Pixel rows [T, H, W, C] (contiguous) as the sequence [1, C, T, H, W] in the frames
    layout: a view."""
    return rows.permute(3, 0, 1, 2)[None]


def cat_time(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[1, C, Ta, H, W] and [1, C, Tb, H, W] one after the other in time, in the layout of
    `b` (torch.cat of two frames-layout tensors would give a channels-first one)."""
    if b.shape[0] == 1 and b.is_contiguous(memory_format=FRAMES) and not b.is_contiguous():
        return sequence_of_rows(torch.cat([rows_of(a), rows_of(b)]))
    return torch.cat([a, b], dim=2)


def frames_weight(weight: torch.Tensor) -> torch.Tensor:
    """A conv weight as the frames layout's 2-D conv takes it: [O, I, kt, kh, kw] ->
    [O, kt I, kh, kw] (taps on the input channels, oldest first), channels-last."""
    if weight.dim() == 5:
        weight = weight.permute(0, 2, 1, 3, 4).flatten(1, 2)
    return weight.contiguous(memory_format=torch.channels_last)


def conv2d_frames(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """A 2-D conv applied to every frame of [B, C, T, H, W] (as a 1 x k x k 3-D conv; in the
    frames layout, a 2-D conv over the frames)."""
    if getattr(conv, "frames_weight", None) is not None:
        y = F.conv2d(frames_of(x), conv.frames_weight, conv.bias, stride=conv.stride,
                     padding=conv.padding)
        return sequence_of(y)
    return F.conv3d(x, conv.weight.unsqueeze(2), conv.bias, stride=(1, *conv.stride),
                    padding=(0, *conv.padding))


class CausalConv3d(nn.Conv3d):
    """A 3-D conv padded by zeros in space and, in time, by its past input frames only."""

    def __init__(self, cin: int, cout: int, kernel: int | tuple[int, int, int]):
        k = (kernel,) * 3 if isinstance(kernel, int) else tuple(kernel)
        super().__init__(cin, cout, k, padding=(0, k[1] // 2, k[2] // 2))
        # set by use_frames_layout; a buffer, so that a move or cast moves it with the weight
        self.register_buffer("frames_weight", None, persistent=False)

    def forward(self, x: torch.Tensor, state: StreamState | None = None,
                own_bias: bool = True) -> torch.Tensor:
        """The conv (own_bias=False: without its bias, in the frames layout only)."""
        n = self.kernel_size[0] - 1
        if self.frames_weight is not None:
            return self._frames_forward(x, state, n, own_bias)
        if not own_bias:
            raise ValueError("a conv leaves its bias out only in the frames layout")
        if n:
            if state is None:
                x = F.pad(x, (0, 0, 0, 0, n, 0))
            else:
                past = state.history(self, x, (x.shape[0], x.shape[1], n, *x.shape[3:]))
                x = torch.cat([past, x], dim=2)
                past.copy_(x[:, :, -n:])
        return super().forward(x)

    def after_norm(self, norm: "RMSNorm", x: torch.Tensor, state: StreamState | None = None,
                   bias: torch.Tensor | None = None, own_bias: bool = True) -> torch.Tensor:
        """self(SiLU(norm(x + bias)), state): `bias` a per-channel bias the conv before left
        out (own_bias=False leaves this conv's out the same way, for the norm after it). In
        the frames layout the norm's taps op writes its output straight into this conv's
        stacked taps and past frames (RMSNorm.taps)."""
        if self.frames_weight is None:
            if bias is not None or not own_bias:
                raise ValueError("biases move between convs and norms only in the frames "
                                 "layout")
            return self(norm(x, silu=True), state)
        t = rows_of(x)
        past = self._past(t, state)
        return self._conv_taps(norm.taps(t, norm.gamma, bias, past, True), own_bias)

    def _past(self, t: torch.Tensor, state: StreamState | None) -> torch.Tensor:
        """The frames layout's past input frames [n, H, W, C] for pixel rows t [T, H, W, C]
        (zeros, not kept, for a whole sequence)."""
        shape = (self.kernel_size[0] - 1, *t.shape[1:])
        return t.new_zeros(shape) if state is None else state.history(self, t, shape)

    def _frames_forward(self, x: torch.Tensor, state: StreamState | None, n: int,
                        own_bias: bool) -> torch.Tensor:
        """The frames layout: the taps stacked from whole contiguous frames [T, H, W, C] (a
        time concatenation of channels-last 5-D tensors would come out channels-first)."""
        t = rows_of(x)
        if not n:
            return self._conv_taps(t, own_bias)
        past = self._past(t, state)
        taps = stacked_taps(past, t)
        keep_past(past, t)
        return self._conv_taps(taps, own_bias)

    def _conv_taps(self, taps: torch.Tensor, own_bias: bool = True) -> torch.Tensor:
        """The frames layout's 2-D conv over stacked taps [F, H, W, (n + 1) C]."""
        y = F.conv2d(taps.permute(0, 3, 1, 2), self.frames_weight,
                     self.bias if own_bias else None, padding=self.padding[1:])
        return sequence_of(y)


def use_frames_layout(module: nn.Module) -> None:
    """Run every conv under `module` in the frames layout, for decoding one sequence at a time
    (batch 1). Each conv's weight is laid out once as its 2-D conv takes it, and the weight
    itself becomes a view of that (the same values, no second copy)."""
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, (CausalConv3d, nn.Conv2d)):
                w = m.weight
                fw = frames_weight(w)
                if w.dim() == 5:  # w[o, i, t, h, w] = fw[o, t I + i, h, w]
                    o, i, kt, kh, kw = w.shape
                    view = fw.as_strided(w.shape, (kh * kw * kt * i, 1, i, kw * kt * i, kt * i))
                else:
                    view = fw
                m.weight.data = view
                m.register_buffer("frames_weight", fw, persistent=False)


def use_row_kernels(module: nn.Module) -> None:
    """In the frames layout, the spatial resizes and the residual blocks' ends under `module`
    as plugins/pixel_rows.py's ops (one kernel each over the pixel rows) in place of
    PyTorch's resize and adds."""
    from ..plugins import pixel_rows

    for m in module.modules():
        if isinstance(m, Upsample):
            m.double_rows = pixel_rows.select("nearest2x")
        if isinstance(m, ResBlock):
            m.bias_residual = pixel_rows.select("bias_residual")


class RMSNorm(nn.Module):
    """Unit L2 norm over channels, times sqrt(channels) and a learned per-channel gain, and
    the SiLU that follows it where asked (ops.channel_rms_norm). `gain_dims` trailing
    singleton dims on the gain: 3 in the conv blocks, 2 in attention."""

    def __init__(self, dim: int, gain_dims: int = 3):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim, *(1,) * gain_dims))
        self.norm = channel_rms_norm  # use_fused_norms: plugins/channel_norm.py's one op
        # the norm written as a causal conv's stacked taps (CausalConv3d.after_norm in the
        # frames layout); use_fused_norms: plugins/channel_norm.py's taps op
        self.taps = channel_norm_taps

    def forward(self, x: torch.Tensor, silu: bool = False) -> torch.Tensor:
        return self.norm(x, self.gamma, silu)


def use_fused_norms(module: nn.Module) -> None:
    """Every RMS norm (and its SiLU) under `module` as plugins/channel_norm.py's one op."""
    from ..plugins import channel_norm

    for m in module.modules():
        if isinstance(m, RMSNorm):
            m.norm = channel_norm.select()
            m.taps = channel_norm.select(taps=True)


class ResBlock(nn.Module):
    """norm, SiLU, causal 3x3x3 conv, twice, plus the input (through a 1x1x1 conv if the width
    changes)."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.residual = numbered({0: RMSNorm(cin), 2: CausalConv3d(cin, cout, 3),
                                  3: RMSNorm(cout), 6: CausalConv3d(cout, cout, 3)})
        self.shortcut = CausalConv3d(cin, cout, 1) if cin != cout else None
        # the frames layout's block end (the last conv's bias and the residual, added to its
        # output in one pass); use_row_kernels: plugins/pixel_rows.py's op
        self.bias_residual = bias_residual_rows

    def forward(self, x: torch.Tensor, state: StreamState | None = None) -> torch.Tensor:
        r = self.residual
        if r["2"].frames_weight is None:
            h = r["2"].after_norm(r["0"], x, state)
            h = r["6"].after_norm(r["3"], h, state)
            return h + (x if self.shortcut is None else self.shortcut(x))
        # the frames layout: the first conv's bias goes into the norm after it, the last
        # conv's (and the shortcut's) into the residual add
        h = r["2"].after_norm(r["0"], x, state, own_bias=False)
        h = r["6"].after_norm(r["3"], h, state, bias=r["2"].bias, own_bias=False)
        bias = r["6"].bias
        if self.shortcut is not None:
            x = self.shortcut(x, own_bias=False)
            bias = bias + self.shortcut.bias
        return sequence_of_rows(self.bias_residual(rows_of(h), bias, rows_of(x)))


class FrameAttention(nn.Module):
    """Single-head self-attention over the pixels of each frame, plus the input."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = RMSNorm(dim, gain_dims=2)
        self.to_qkv = nn.Conv2d(dim, 3 * dim, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x: torch.Tensor, state: StreamState | None = None) -> torch.Tensor:
        b, c, t, h, w = x.shape
        qkv = conv2d_frames(self.to_qkv, self.norm(x))  # [B, 3C, T, H, W]
        qkv = qkv.view(b, 3, c, t, h * w).permute(1, 0, 3, 4, 2).reshape(3, b * t, 1, h * w, c)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])  # [B*T, 1, HW, C]
        y = y.view(b, t, h, w, c).permute(0, 4, 1, 2, 3)
        return conv2d_frames(self.proj, y) + x


class Downsample(nn.Module):
    """Halve space (pad right and bottom, 3x3 conv, stride 2); with `temporal`, then halve time:
    frame 0 stays, and a 3-tap stride-2 conv over frames (0, 1, 2), (2, 3, 4), ... follows it."""

    def __init__(self, dim: int, temporal: bool):
        super().__init__()
        self.temporal = temporal
        self.resample = numbered({1: nn.Conv2d(dim, dim, 3, stride=2)})
        if temporal:
            self.time_conv = nn.Conv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1))

    def forward(self, x: torch.Tensor, state: StreamState | None = None) -> torch.Tensor:
        x = conv2d_frames(self.resample["1"], F.pad(x, (0, 1, 0, 1)))
        if self.temporal and x.shape[2] > 1:
            x = torch.cat([x[:, :, :1], self.time_conv(x)], dim=2)
        return x


def double_space(x: torch.Tensor) -> torch.Tensor:
    """Nearest 2x in height and width of [B, C, T, H, W] as a 2-D resize of its frames (the
    3-D resize with a time factor of 1 gives the same values several times slower)."""
    b, c, t, h, w = x.shape
    y = F.interpolate(x.reshape(b, c * t, h, w), scale_factor=2.0, mode="nearest")
    return y.view(b, c, t, 2 * h, 2 * w)


class Upsample(nn.Module):
    """With `temporal`, first double time: a causal 3-tap conv to twice the channels, read as
    two frames per input frame (a session's frame 0 stays one frame and is not part of that
    conv's input); then double space (nearest) and a 3x3 conv to half the channels."""

    def __init__(self, dim: int, temporal: bool):
        super().__init__()
        self.temporal = temporal
        self.resample = numbered({1: nn.Conv2d(dim, dim // 2, 3, padding=1)})
        if temporal:
            self.time_conv = CausalConv3d(dim, 2 * dim, (3, 1, 1))
        # the frames layout's resize of pixel rows; use_row_kernels: plugins/pixel_rows.py's op
        self.double_rows = nearest2x_rows

    def forward(self, x: torch.Tensor, state: StreamState | None = None) -> torch.Tensor:
        if self.temporal:
            x = self._double_time(x, state)
        if getattr(self.resample["1"], "frames_weight", None) is not None:
            x = sequence_of_rows(self.double_rows(rows_of(x)))
        else:
            x = double_space(x)
        return conv2d_frames(self.resample["1"], x)

    def _double_time(self, x: torch.Tensor, state: StreamState | None) -> torch.Tensor:
        first = None
        if state is None or not state.started:
            first, x = x[:, :, :1], x[:, :, 1:]
            if x.shape[2] == 0:
                return first
        b, c, t, h, w = x.shape
        y = self.time_conv(x, state)
        if self.time_conv.frames_weight is not None:  # rows [t, h, w, 2, c] -> [t, 2, h, w, c]
            rows = rows_of(y).view(t, h, w, 2, c).permute(0, 3, 1, 2, 4)
            x = sequence_of_rows(rows.reshape(2 * t, h, w, c))
        else:
            x = y.view(b, 2, c, t, h, w).permute(0, 2, 3, 1, 4, 5).reshape(b, c, 2 * t, h, w)
        return x if first is None else cat_time(first, x)


class Encoder(nn.Module):
    """Video [B, 3, 1 + 4k, H, W] in [-1, 1] -> [B, 2 z, 1 + k, H/8, W/8] (mean, log-variance)
    before the VAE's own 1x1x1 conv."""

    def __init__(self, spec):
        super().__init__()
        dims = [spec.dim * m for m in (1, *spec.dim_mult)]
        self.conv1 = CausalConv3d(3, dims[0], 3)
        blocks: list[nn.Module] = []
        cin = dims[0]
        for i, cout in enumerate(dims[1:]):
            for _ in range(spec.num_res_blocks):
                blocks.append(ResBlock(cin, cout))
                cin = cout
            if i < len(spec.dim_mult) - 1:
                blocks.append(Downsample(cout, spec.temporal_downsample[i]))
        self.downsamples = nn.ModuleList(blocks)
        self.middle = nn.ModuleList([ResBlock(cin, cin), FrameAttention(cin), ResBlock(cin, cin)])
        self.head = numbered({0: RMSNorm(cin), 2: CausalConv3d(cin, 2 * spec.z_dim, 3)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x)
        for m in (*self.downsamples, *self.middle):
            x = m(x)
        return self.head["2"](self.head["0"](x, silu=True))


class Decoder(nn.Module):
    """Latents [B, z, F, h, w] (after the VAE's 1x1x1 conv) -> video [B, 3, n, 8 h, 8 w], about
    [-1, 1]; n = 4 F, less 3 when the call holds the session's first latent."""

    def __init__(self, spec):
        super().__init__()
        mult = spec.dim_mult
        dims = [spec.dim * m for m in (mult[-1], *reversed(mult))]
        temporal = tuple(reversed(spec.temporal_downsample))
        self.conv1 = CausalConv3d(spec.z_dim, dims[0], 3)
        self.middle = nn.ModuleList([ResBlock(dims[0], dims[0]), FrameAttention(dims[0]),
                                     ResBlock(dims[0], dims[0])])
        blocks: list[nn.Module] = []
        cin = dims[0]
        for i, cout in enumerate(dims[1:]):
            for _ in range(spec.num_res_blocks + 1):
                blocks.append(ResBlock(cin, cout))
                cin = cout
            if i < len(mult) - 1:
                blocks.append(Upsample(cout, temporal[i]))
                cin = cout // 2
        self.upsamples = nn.ModuleList(blocks)
        self.head = numbered({0: RMSNorm(cin), 2: CausalConv3d(cin, 3, 3)})

    def forward(self, z: torch.Tensor, state: StreamState | None = None) -> torch.Tensor:
        x = self.conv1(z, state)
        for m in (*self.middle, *self.upsamples):
            x = m(x, state)
        return self.head["2"].after_norm(self.head["0"], x, state)
