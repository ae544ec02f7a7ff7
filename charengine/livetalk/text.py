"""The prompt LiveTalk's DiT cross-attends to: umT5 encoder states, [tokens, dim] (512 x 4096 for
umT5-XXL), computed once per prompt.

Three sources: a safetensors file holding the states (`load_prompt_embeddings`), transformers'
UMT5EncoderModel with its tokenizer from a local directory (`Umt5Prompt`), or, for the CPU tiny
model, a small random UMT5 encoder over UTF-8 bytes (`TinyUmt5Prompt`). Each pads the prompt to
`tokens` positions with the end token included, and zeroes the states at the padded positions
as Wan's text encoder does, so the padding contributes zero keys and values."""

from __future__ import annotations

import html
import re
import unicodedata
from pathlib import Path

import torch

from ..checkpoint import CheckpointError, read_safetensors

_QUOTES = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201a": "'", "\u201b": "'",
                         "\u201c": '"', "\u201d": '"', "\u201e": '"', "\u201f": '"'})


def clean_prompt(text: str) -> str:
    """Wan's whitespace cleaning: HTML entities decoded (twice), straight quotes, Unicode NFC,
    runs of whitespace made one space, the ends stripped. (Wan also runs ftfy's mojibake
    repair first; ordinary text does not need it.)"""
    text = html.unescape(html.unescape(unicodedata.normalize("NFC", text))).translate(_QUOTES)
    return re.sub(r"\s+", " ", text).strip()


def load_prompt_embeddings(path, tokens: int, dim: int) -> torch.Tensor:
    """The prompt's states from a safetensors file with one tensor, [tokens, dim] or
    [1, tokens, dim], as float32 [tokens, dim]; anything else is one CheckpointError line."""
    path = Path(path)
    state = read_safetensors(path)
    if len(state) != 1:
        raise CheckpointError(f"{path}: a prompt embeddings file holds one tensor, this one "
                              f"holds {len(state)}")
    (name, t), = state.items()
    if t.ndim == 3 and t.shape[0] == 1:
        t = t[0]
    if tuple(t.shape) != (tokens, dim):
        raise CheckpointError(f"{path}: tensor {name!r} has shape {list(state[name].shape)}, "
                              f"the prompt needs [{tokens}, {dim}] (or [1, {tokens}, {dim}])")
    if not t.is_floating_point():
        raise CheckpointError(f"{path}: tensor {name!r} has dtype {t.dtype}, expected a float")
    if not bool(torch.isfinite(t).all()):
        raise CheckpointError(f"{path}: tensor {name!r} holds non-finite values")
    return t.float().contiguous()


def save_prompt_embeddings(path, states: torch.Tensor) -> None:
    """A file `load_prompt_embeddings` reads (one tensor, `prompt_embeds`)."""
    from safetensors.torch import save_file

    save_file({"prompt_embeds": states.detach().float().contiguous().cpu()}, str(path))


def _encode(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[tokens] ids and mask -> float32 [tokens, dim], zero past the prompt's length."""
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model(input_ids=ids[None].to(device), attention_mask=mask[None].to(device))
    states = out.last_hidden_state[0].float()
    return states * mask.to(states.device, torch.float32)[:, None]


class Umt5Prompt:
    """transformers' UMT5EncoderModel and its tokenizer from a local directory."""

    def __init__(self, path, tokens: int, dim: int, dtype=torch.float32, device="cpu"):
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(f"{path}: no such umT5 directory")
        from transformers import AutoTokenizer, UMT5EncoderModel

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            model = UMT5EncoderModel.from_pretrained(str(path), local_files_only=True,
                                                     dtype=dtype)
        except Exception as e:  # transformers' own errors: one line with the cause
            msg = " ".join(str(e).split())[:300] or type(e).__name__
            raise CheckpointError(f"{path}: unreadable umT5 encoder ({msg})") from None
        if model.config.d_model != dim:
            raise CheckpointError(f"{path}: umT5 width is {model.config.d_model}, the DiT's "
                                  f"text dim is {dim}")
        self.model = model.to(device).eval().requires_grad_(False)
        self.tokens, self.dim = tokens, dim

    def ids(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and mask [tokens]: the cleaned prompt, its end token, padding."""
        enc = self.tokenizer([clean_prompt(prompt)], padding="max_length", truncation=True,
                             max_length=self.tokens, add_special_tokens=True,
                             return_tensors="pt")
        return enc.input_ids[0], enc.attention_mask[0]

    def encode(self, prompt: str) -> torch.Tensor:
        """float32 [tokens, dim], zero at the padded positions."""
        return _encode(self.model, *self.ids(prompt))


class TinyUmt5Prompt:
    """A random 2-layer UMT5 encoder of width `dim` over UTF-8 bytes (id = byte + 2; 0 pads,
    1 ends), for the CPU tiny model: no tokenizer files. The same seed builds the same
    weights."""

    PAD, END, OFFSET = 0, 1, 2

    def __init__(self, tokens: int, dim: int, seed: int = 0, heads: int = 2):
        from transformers import UMT5Config, UMT5EncoderModel

        cfg = UMT5Config(vocab_size=256 + self.OFFSET, d_model=dim, d_kv=dim // heads,
                         d_ff=2 * dim, num_layers=2, num_heads=heads,
                         relative_attention_num_buckets=32, relative_attention_max_distance=128,
                         feed_forward_proj="gated-gelu", pad_token_id=self.PAD,
                         eos_token_id=self.END, decoder_start_token_id=self.PAD)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.model = UMT5EncoderModel(cfg).eval().requires_grad_(False)
        self.tokens, self.dim = tokens, dim

    def ids(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        data = [b + self.OFFSET for b in clean_prompt(prompt).encode("utf-8")][:self.tokens - 1]
        data.append(self.END)
        ids = torch.full((self.tokens,), self.PAD, dtype=torch.long)
        ids[:len(data)] = torch.tensor(data)
        mask = (torch.arange(self.tokens) < len(data)).long()
        return ids, mask

    def encode(self, prompt: str) -> torch.Tensor:
        return _encode(self.model, *self.ids(prompt))
