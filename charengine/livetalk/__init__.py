"""The LiveTalk family: LiveTalk-1.3B (Wan 2.1 T2V-1.3B with OmniAvatar's audio
conditioning, distilled to four passes per block-causal chunk) and its side networks (the
Wan 2.1 VAE, wav2vec2-base, umT5 prompt features). `FAMILY` is its side of
charengine/family.py's interface; the members import their modules when called, so naming
the family costs nothing."""

from __future__ import annotations

from ..family import BuildInput, FamilyModules


class LiveTalk(FamilyModules):
    package = __name__
    name = "livetalk"

    @property
    def spec_type(self):
        from .spec import LiveTalkSpec

        return LiveTalkSpec

    @property
    def presets(self):
        from .spec import PRESETS

        return PRESETS

    @property
    def config_types(self):
        from .spec import LiveTalkCache, LiveTalkSchedule, LiveTalkSwitches

        return {"cache": LiveTalkCache, "schedule": LiveTalkSchedule,
                "switches": LiveTalkSwitches}

    def check_config(self, cfg) -> None:
        if cfg.switches.fp8_kv and not cfg.numerics.fp8_attention:
            raise ValueError("fp8_kv=True stores K/V for FP8 attention: set "
                             "numerics.fp8_attention=True, or fp8_kv=False for a bf16 cache.")
        sw = cfg.switches
        for name, used in (("fused_pre_attention", sw.fp8_kv), ("fused_wide_pre_attention", True)):
            if getattr(sw, name) and used and not sw.rope_tables:
                raise ValueError(f"{name} rotates by the RoPE tables: set rope_tables=True, "
                                 f"or {name}=False")
        if cfg.switches.position_reset and not cfg.switches.ring_cache and \
                cfg.cache.reset_period < cfg.model.window_chunks - 1:
            raise ValueError("cache.reset_period is shorter than the window: a key would be "
                             "rotated twice")
        cfg.model.check_tp(cfg.tp)

    @property
    def side_prefixes(self):
        from .sidenets import PREFIXES

        return PREFIXES

    side_files_hint = " (LiveTalk's come from --vae, --wav2vec and --prompt-features or " \
        "--text-encoder)"
    build_inputs = (
        BuildInput("vae", "the Wan 2.1 VAE (Wan2.1_VAE.pth; read with weights_only)."),
        BuildInput("wav2vec", "a local wav2vec2-base-960h directory (transformers)."),
        BuildInput("prompt_features",
                   "the prompt as umT5-XXL features [512, 4096] in a safetensors file."),
        BuildInput("text_encoder",
                   "a local umT5 encoder directory (transformers) to encode --prompt."),
        BuildInput("prompt", "the prompt --text-encoder encodes.", path=False))
    embedded_checkpoints: dict[str, str] = {}
    random_ok = ("tiny-livetalk",)

    def load_side(self, cfg, side: dict, device="cpu"):
        from .sidenets import load_side

        return load_side(cfg.model, side, device, cfg.switches)

    def load_side_files(self, spec, files: dict, seed: int):
        from pathlib import Path

        from .sidenets import load_side_files

        path = {k: Path(v) for k, v in files.items() if k != "prompt"}
        return load_side_files(spec, path.get("vae"), path.get("wav2vec"),
                               path.get("prompt_features"), path.get("text_encoder"),
                               files.get("prompt", ""), seed)

    def load_checkpoint(self, path, spec):
        """(DiT state, {}): LiveTalk's side networks come from their own files
        (load_side_files)."""
        from .weights import load_checkpoint

        return load_checkpoint(path, spec), {}

    def random_weights(self, spec, seed: int, device="cpu"):
        from .weights import random_weights

        return random_weights(spec, seed, device=device)

    def bench_weights(self, spec, seed: int, device="cpu"):
        from .weights import device_random_weights

        return device_random_weights(spec, seed, device)

    def bake_tables(self, cfg, state):
        from .rank import bake_tables

        return bake_tables(cfg, state)

    def tables_of(self, tables: dict):
        return tables

    def rank_weights(self, cfg, state, mapping):
        return self.rank_state(cfg, state, mapping.rank)

    def rank_shape(self, cfg, rank: int):
        return (cfg.model.n_heads, cfg.model.ffn_dim)

    def rank_state(self, cfg, full_state, rank: int = 0, keep_adaln: bool = True):
        import torch

        from .weights import rank_weights

        return rank_weights(cfg.model, full_state, cfg.numerics.fp8_gemm,
                            getattr(torch, cfg.numerics.dtype))

    def rank_session(self, cfg, state, mapping, tables=None, gemm_plan=None, exchange=None,
                     graphed=None, **options):
        from .rank import rank_session

        return rank_session(cfg, state, mapping, tables, gemm_plan, graphed, **options)

    def gemm_problems(self, cfg, state, mapping):
        from .rank import gemm_problems

        return gemm_problems(cfg, state, mapping)

    def step_shapes(self, spec):
        from ..family import StepShapes

        latent = (spec.latent_channels, spec.chunk_frames, spec.latent_h, spec.latent_w)
        return StepShapes((spec.latent_channels, spec.latent_h, spec.latent_w),
                          (spec.prompt_tokens, spec.text_dim), (spec.audio_rows, spec.audio_dim),
                          latent, noise=(4,) + latent)

    def step_frames(self, spec, k: int) -> int:
        return spec.first_step_frames if k == 0 else spec.frames_per_latent

    def steps_for(self, spec, n_samples: int) -> int:
        from .audio import steps_for

        return steps_for(spec.audio, n_samples)

    def step_bounds(self, spec, k: int):
        from .audio import chunk_samples

        return chunk_samples(spec.audio, k)

    def window_samples(self, spec) -> int:
        from .audio import window_samples

        return window_samples(spec.audio)

    def audio_window(self, spec, speech, k: int):
        from .audio import chunk_window

        return chunk_window(spec.audio, speech, k)

    def encode_audio(self, side, spec, window, k: int):
        return side.audio_features(window, k)

    def decode_pieces(self, side, latent, decoder=None):
        return (decoder or side.decoder).per_latent(latent)

    def steady_from(self, cfg) -> int:
        return self._module("cache").first_steady_chunk(cfg)

    def steady_audio_step(self, spec) -> int:
        from .audio_graph import first_full_chunk

        return first_full_chunk(spec.audio)

    def lookahead_samples(self, spec) -> int:
        a = spec.audio
        return a.lookahead_frames * a.sample_rate // a.fps


FAMILY = LiveTalk()
