"""The characters family: the paper's DiT as we infer it (parallel blocks with AdaLN, QK
RMS-norm, 3-D RoPE and SwiGLU; one KV cache per (block, pass) with global slots and a window
of latent frames; a fixed four-pass schedule; its own side networks). `FAMILY` is its side of
charengine/family.py's interface; the members import their modules when called, so naming
the family costs nothing."""

from __future__ import annotations

from ..family import FamilyModules


class Characters(FamilyModules):
    package = __name__
    name = "characters"

    @property
    def spec_type(self):
        from .spec import ModelSpec

        return ModelSpec

    @property
    def presets(self):
        from .spec import PRESETS

        return PRESETS

    @property
    def config_types(self):
        from .config import CacheSpec, Schedule, Switches

        return {"cache": CacheSpec, "schedule": Schedule, "switches": Switches}

    def check_config(self, cfg) -> None:
        from .config import check_characters

        check_characters(cfg)

    side_files_hint = ""
    build_inputs = ()
    embedded_checkpoints = {"tiny": "tiny.safetensors"}
    random_ok = ("tiny-10h",)

    def load_side_files(self, spec, files: dict, seed: int):
        from ..checkpoint import CheckpointError

        raise CheckpointError(f"{spec.name} takes its side networks from its checkpoint; "
                              f"{', '.join(sorted(files))} are LiveTalk's files")

    def step_frames(self, spec, k: int) -> int:
        return spec.frames_per_latent

    def encode_audio(self, side, spec, window, k: int):
        return side.audio_encoder(window)

    def fused_allreduce(self, cfg):
        """The output projection's GEMM with its all-reduce (plugins/gemm_allreduce.py)."""
        from ..family import FusedAllReduce

        if not cfg.switches.fused_gemm_allreduce:
            return None
        return FusedAllReduce("blocks.0.w_out", cfg.model.tokens_per_frame, cfg.model.dim)

    def quack_epilogues(self, cfg) -> bool:
        return cfg.switches.gemm_swiglu and cfg.numerics.fp8_gemm

    def lookahead_samples(self, spec) -> int:
        return 0

    @property
    def side_prefixes(self):
        from .sidenets import PREFIXES

        return PREFIXES

    def load_checkpoint(self, path, spec):
        from .sidenets import PREFIXES
        from .weights import load_checkpoint

        return load_checkpoint(path, spec, PREFIXES)

    def random_weights(self, spec, seed: int, device="cpu"):
        from .weights import RandomWeights

        return RandomWeights(spec, seed, device)

    def bake_tables(self, cfg, state):
        from .model import bake_adaln

        table, final = bake_adaln(cfg, state)
        return {"adaln_table": table, "final_table": final}

    @staticmethod
    def _tables_of(tables: dict):
        """The model's view of the baked tables (the engine's ADALN file's tensors)."""
        return tables["adaln_table"], tables["final_table"]

    def rank_weights(self, cfg, state, mapping):
        from .rank import rank_state

        return rank_state(cfg, state, mapping.rank, keep_adaln=not cfg.switches.baked_adaln)

    def rank_shape(self, cfg, rank: int):
        """What a rank's kernels depend on: its heads and MLP channels (ranks of one shape
        share their compiled kernels and GEMM choices)."""
        from .spec import RankShape

        shape = RankShape.of(cfg.model, cfg.tp, rank)
        return shape.heads, shape.mlp

    def rank_state(self, cfg, full_state, rank: int = 0, keep_adaln: bool = True):
        from .rank import rank_state

        return rank_state(cfg, full_state, rank, keep_adaln)

    def rank_session(self, cfg, state, mapping, tables=None, gemm_plan=None, exchange=None,
                     graphed=None, **options):
        from .rank import rank_session

        if isinstance(tables, dict):
            tables = self._tables_of(tables)
        return rank_session(cfg, state, mapping, tables, gemm_plan, exchange, graphed,
                            **options)

    def gemm_problems(self, cfg, state, mapping):
        from .ops import gemm_problems

        return gemm_problems(cfg, state, mapping)

    def step_shapes(self, spec):
        from ..family import StepShapes

        latent = (spec.latent_channels, spec.latent_h, spec.latent_w)
        return StepShapes(latent, (spec.prompt_tokens, spec.text_dim),
                          (spec.audio_tokens, spec.audio_dim), latent)

    def steps_for(self, spec, n_samples: int) -> int:
        from .audio import steps_for

        return steps_for(spec, n_samples)

    def step_bounds(self, spec, k: int):
        from .audio import step_bounds

        return step_bounds(spec, k)

    def window_samples(self, spec) -> int:
        from .audio import window_samples

        return window_samples(spec)

    def audio_window(self, spec, speech, k: int):
        from .audio import step_window

        return step_window(spec, speech, k)


FAMILY = Characters()
