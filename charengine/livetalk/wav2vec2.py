"""wav2vec2's network in plain torch, under transformers' Wav2Vec2Model parameter names: what a
LiveTalk engine runs, so that the runtime never imports transformers (its import is most of a
cold start's side-network build). A checkpoint's state dict loads unchanged either way, and
tests/test_livetalk_audio.py holds this forward to transformers' on the same weights.

Only what LiveTalk's shapes use: the group-norm feature encoder (`feat_extract_norm="group"`,
convs without bias, exact GELU), the post-norm encoder (`do_stable_layer_norm=False`), the
weight-normed positional conv, inference only (no dropout, no time masking)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

LAYER_NORM_EPS = 1e-5  # wav2vec2-base's layer_norm_eps; GroupNorm's default is the same


class ConvLayer(nn.Module):
    """One feature-encoder conv, then (the first layer only) a GroupNorm of one channel per
    group, then GELU."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, norm: bool):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, stride=stride, bias=False)
        self.layer_norm = nn.GroupNorm(cout, cout, eps=LAYER_NORM_EPS) if norm else None
        self.activation = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        return self.activation(x)


class FeatureEncoder(nn.Module):
    """Samples [B, S] -> CNN features [B, C, T]."""

    def __init__(self, spec):
        super().__init__()
        dims = (1, *spec.conv_dim)
        self.conv_layers = nn.ModuleList(
            ConvLayer(dims[i], dims[i + 1], k, s, norm=i == 0)
            for i, (k, s) in enumerate(zip(spec.conv_kernel, spec.conv_stride)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x[:, None]
        for layer in self.conv_layers:
            x = layer(x)
        return x


class FeatureProjection(nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.layer_norm = nn.LayerNorm(spec.conv_dim[-1], eps=LAYER_NORM_EPS)
        self.projection = nn.Linear(spec.conv_dim[-1], spec.hidden)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the projection, the normalized input), as transformers gives them."""
        normed = self.layer_norm(h)
        return self.projection(normed), normed


class PositionalConv(nn.Module):
    """A grouped conv over time, weight-normed over its kernel positions (dim 2), padded to keep
    the length (an even kernel's extra last position dropped), then GELU: [B, T, C] in and
    out. The weight's magnitude and direction are kept under the names torch's weight_norm
    parametrization gives them (`conv.parametrizations.weight.original0` and `original1`), and
    the weight is formed from them as it forms it, at each call (making the parametrization
    itself on the meta device imports most of torch's reference ops)."""

    def __init__(self, spec):
        super().__init__()
        k, c, groups = spec.pos_conv_kernel, spec.hidden, spec.pos_conv_groups
        self.padding, self.groups, self.drop_last = k // 2, groups, 1 - k % 2
        self.conv = nn.Module()
        self.conv.bias = nn.Parameter(torch.empty(c))
        self.conv.parametrizations = nn.Module()
        self.conv.parametrizations.weight = nn.ParameterDict({
            "original0": nn.Parameter(torch.empty(1, 1, k)),
            "original1": nn.Parameter(torch.empty(c, c // groups, k))})

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        p = self.conv.parametrizations.weight
        w = torch._weight_norm(p["original1"], p["original0"], 2)
        x = F.conv1d(h.transpose(1, 2), w, self.conv.bias, padding=self.padding,
                     groups=self.groups)
        if self.drop_last:
            x = x[:, :, :-self.drop_last]
        return F.gelu(x).transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.k_proj, self.v_proj, self.q_proj, self.out_proj = (  # transformers' key order
            nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, h: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        b, t, c = h.shape
        q, k, v = (p(h).view(b, t, self.heads, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias,
                                           scale=(c // self.heads) ** -0.5)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, c))


class FeedForward(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.intermediate_dense = nn.Linear(hidden, intermediate)
        self.output_dense = nn.Linear(intermediate, hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.output_dense(F.gelu(self.intermediate_dense(h)))


class EncoderLayer(nn.Module):
    """Post-norm: attention, residual, norm; feed-forward, residual, norm."""

    def __init__(self, spec):
        super().__init__()
        self.attention = Attention(spec.hidden, spec.heads)
        self.layer_norm = nn.LayerNorm(spec.hidden, eps=LAYER_NORM_EPS)
        self.feed_forward = FeedForward(spec.hidden, spec.intermediate)
        self.final_layer_norm = nn.LayerNorm(spec.hidden, eps=LAYER_NORM_EPS)

    def forward(self, h: torch.Tensor, attention_mask: torch.Tensor | None = None):
        """`attention_mask`: additive, broadcast to [B, heads, T, T] (transformers' form)."""
        h = self.layer_norm(h + self.attention(h, attention_mask))
        return self.final_layer_norm(h + self.feed_forward(h))


class Encoder(nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.pos_conv_embed = PositionalConv(spec)
        self.layer_norm = nn.LayerNorm(spec.hidden, eps=LAYER_NORM_EPS)
        self.dropout = nn.Identity()  # inference: the name transformers' encoder gives it
        self.layers = nn.ModuleList(EncoderLayer(spec) for _ in range(spec.layers))


class Wav2Vec2(nn.Module):
    """The parts of transformers' Wav2Vec2Model that LiveTalk's AudioEncoder calls, with its
    state dict keys (`masked_spec_embed` included, unused at inference)."""

    def __init__(self, spec):
        super().__init__()
        self.masked_spec_embed = nn.Parameter(torch.empty(spec.hidden))
        self.feature_extractor = FeatureEncoder(spec)
        self.feature_projection = FeatureProjection(spec)
        self.encoder = Encoder(spec)
