"""A small byte-level text encoder for the prompt: UTF-8 bytes -> prompt_tokens features.

Prompts longer than prompt_tokens bytes are cut; shorter ones are padded with zero features
(as Wan pads its text context), so the global slots always hold prompt_tokens entries.
"""

from __future__ import annotations

import torch

from .spec import ModelSpec


class TextEncoder(torch.nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        s = spec.side
        self.spec = spec
        self.embed = torch.nn.Embedding(256, s.text_width)
        self.pos = torch.nn.Parameter(torch.zeros(spec.prompt_tokens, s.text_width))
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(s.text_width, s.text_heads, 4 * s.text_width,
                                             dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(s.text_layers))
        self.out = torch.nn.Linear(s.text_width, spec.text_dim)

    def forward(self, prompt: str) -> torch.Tensor:
        """-> features [prompt_tokens, text_dim]."""
        n = self.spec.prompt_tokens
        ids = list(prompt.encode("utf-8"))[:n]
        feats = torch.zeros(n, self.spec.text_dim, device=self.pos.device)
        if not ids:
            return feats
        x = self.embed(torch.tensor(ids, device=self.pos.device)) + self.pos[: len(ids)]
        x = x[None]
        for layer in self.layers:
            x = layer(x)
        feats[: len(ids)] = self.out(x[0])
        return feats
