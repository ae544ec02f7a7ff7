"""Model families: the seam a second model plugs in at.

A family is a package under `charengine/` whose `FAMILY` object has the members of `Family`
below, in six parts: Shapes (its spec type, presets and config types), Checkpoint (its
layout, loader and random weights), Rank (the tables it bakes for the fixed schedule, how a
TP rank's weights are cut, the one assembly of a rank's model, cache and session through
charengine/stepping.py), Speech (which speech each step plays), Side (its side networks:
audio and image encoders, decoder, text encoder, and their graphs for ONNX export) and Bench
(what the benchmark scripts run and count: the named configs they compare, the waterfall
among them, a rank's random weights, a step's FLOPs and kernel groups). The
builder, the runtime and the scripts speak to a family only through these members, so a
family is added by writing its package and naming it in FAMILIES; no other family's code
changes. docs/ARCHITECTURE.md draws where it plugs in.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

# family name -> the module holding its FAMILY
FAMILIES = {"characters": "charengine.characters", "livetalk": "charengine.livetalk"}


@dataclass(frozen=True)
class StepShapes:
    """The tensors a session hands between the host process and its TP ranks: the reference
    latent and the prompt features once per session; per step, the audio features and the
    step's noise in and the clean latent out (`noise` None: the latent's shape)."""

    reference: tuple[int, ...]
    prompt: tuple[int, ...]
    features: tuple[int, ...]
    latent: tuple[int, ...]
    noise: tuple[int, ...] | None = None

    @property
    def noise_shape(self) -> tuple[int, ...]:
        return self.latent if self.noise is None else self.noise


@dataclass
class GemmProblem:
    """What charbuild times for one kind of block linear (a family's `gemm_problems`): its
    epilogue, every block's weights, the steady M, and the epilogue's extra input (the
    SwiGLU split, the residual); `fast_accum`, whether the model runs the kind without
    promoted sums (None: the numerics' `fast_accum_for(kind)`, the characters family's)."""

    epilogue: str
    weights: list
    m: int
    split: int = 0
    residual: torch.Tensor | None = None
    fast_accum: bool | None = None


@dataclass(frozen=True)
class FusedAllReduce:
    """A TP rank's GEMM whose output is all-reduced in the same kernel (a family's
    `fused_allreduce`): the linear it computes (its engine tensors `<linear>.q` and
    `<linear>.scale`) and the steady shape of its output, m rows of n."""

    linear: str
    m: int
    n: int


@dataclass(frozen=True)
class BuildInput:
    """A file or text a family's build takes besides its checkpoint (a family's
    `build_inputs`): charbuild's flag --NAME (underscores as dashes), the key `name` in
    BuildConfig.side_files, its help line, and whether it is a path or a text."""

    name: str
    help: str
    path: bool = True

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


# Name prefixes of a causal cache's tensors in an exported graph: a conv's past input frames
# going in, the frames it keeps for the next call coming out (followed by the module's path).
PAST, PRESENT = "past.", "present."


@dataclass
class OnnxGraph:
    """One side network as the runtime calls it, for ONNX export (a family's `onnx_graphs`):
    `module`'s forward takes the tensors named `inputs`, in that order, and returns those
    named `outputs`, every shape fixed by the spec. `calls` are the inputs of a session's
    successive calls, to check the export by: the first call gives every input, a later one
    only those not in `carry`, which maps an output to the input it becomes at the next call
    (a causal cache). `doc` says what one call computes."""

    name: str
    module: torch.nn.Module
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    calls: list[dict[str, torch.Tensor]]
    carry: dict[str, str] = field(default_factory=dict)
    doc: str = ""


class Shapes(Protocol):
    """Part 1, what the family is: its spec type and presets (data), the config types it
    puts in an EngineConfig, its invalid combinations, the tensors a session hands between
    the host and its ranks. A spec has what delivery reads: `name`, `fps`,
    `frames_per_latent` (frames per step), `out_h`, `out_w` and `side.sample_rate`."""

    name: str
    spec_type: type  # the frozen dataclass of the family's shapes (EngineConfig.model)
    presets: dict[str, Any]  # preset name -> spec
    # EngineConfig field -> the family's dataclass for it ("cache", "schedule", "switches")
    config_types: dict[str, type]

    def check_config(self, cfg) -> None:
        """Invalid combinations of an EngineConfig of this family, one line each."""

    def step_shapes(self, spec) -> StepShapes:
        """The shapes of a session's hand-offs (runtime/distributed.py, the warm-up)."""

    def block_linear_params(self, spec) -> int:
        """Parameters of the block linears (the engine manifest's count)."""


class Checkpoint(Protocol):
    """Part 2, the weights: the checkpoint layout and its loader (one line naming a bad
    tensor), random weights of the same shapes, the side networks' own files."""

    side_prefixes: tuple[str, ...]  # checkpoint key prefixes of the side networks
    side_files_hint: str  # how a checkpoint without side networks gets them (a message)
    build_inputs: tuple[BuildInput, ...]  # the side networks' own files, charbuild's flags
    # preset -> its trained checkpoint shipped in charengine/checkpoints/ (built from when
    # charbuild is given no weights)
    embedded_checkpoints: dict[str, str]
    random_ok: tuple[str, ...]  # presets built with random weights without asking (tests)

    def param_shapes(self, spec) -> dict[str, tuple[int, ...]]:
        """Every full-precision DiT tensor of the checkpoint layout and its shape."""

    def load_checkpoint(self, path, spec) -> tuple[dict, dict]:
        """(DiT state, side-network state) from a checkpoint; one line naming a bad tensor."""

    def random_weights(self, spec, seed: int, device="cpu") -> dict:
        """A lazily made full state of the exact shapes (benchmarks, the tiny engines)."""

    def bench_weights(self, spec, seed: int, device) -> dict:
        """Random weights of the exact shapes made fast on `device` for the benchmarks at
        full size (not random_weights' values where those are drawn on the host)."""

    def load_side_files(self, spec, files: dict, seed: int) -> dict:
        """The side state from the side networks' own files (BuildConfig.side_files)."""


class Rank(Protocol):
    """Part 3, one TP rank: the tables baked for the fixed schedule, the rank's cut of the
    weights, its GEMMs for the builder to time, and the one assembly of its model, cache and
    session (the session, its graphs and warm-up are charengine/stepping.py's; a family
    gives its step function and phase rule, and where it has one its batched step, which
    rank_session hands to session_of)."""

    def bake_tables(self, cfg, state) -> dict[str, torch.Tensor]:
        """The tables baked for the fixed schedule (the engine's ADALN file)."""

    def rank_weights(self, cfg, state, mapping) -> dict[str, torch.Tensor]:
        """TP rank `mapping.rank`'s engine state (FP8 weights and scales) from a full state."""

    def rank_state(self, cfg, full_state, rank: int = 0, keep_adaln: bool = True) -> dict:
        """As rank_weights, for tests and benchmarks that keep what the tables bake from."""

    def rank_shape(self, cfg, rank: int):
        """A hashable key of what rank `rank`'s kernels depend on (equal keys share them)."""

    def rank_session(self, cfg, state, mapping, tables=None, gemm_plan=None, exchange=None,
                     graphed: bool = False):
        """The one assembly of a rank: its model, cache and session."""

    def warm_up(self, session) -> int:
        """Run every phase of a session once (compiles kernels, captures graphs)."""

    def gemm_problems(self, cfg, state, mapping) -> dict:
        """The GEMMs the builder's plan chooses for: linear -> (epilogue, weights, M)."""

    def steady_from(self, cfg) -> int:
        """The first step of the steady shape: the steps before it fill the cache and may
        take longer than a steady one (a live session's deadlines leave their times out
        once it has measured a steady step)."""

    def fused_allreduce(self, cfg) -> FusedAllReduce | None:
        """The GEMM + all-reduce the config fuses on a TP group, None where it has none."""

    def quack_epilogues(self, cfg) -> bool:
        """Whether the config runs QuACK's fused GEMM epilogues whatever the GEMM plan says."""


class Speech(Protocol):
    """Part 4, time: which speech each step plays and the audio encoder's window of it."""

    def step_frames(self, spec, k: int) -> int:
        """Video frames step k gives (the decoder's output for its latent)."""

    def steps_for(self, spec, n_samples: int) -> int:
        """Steps that cover n_samples of speech."""

    def step_bounds(self, spec, k: int) -> tuple[int, int]:
        """The speech samples [a, b) step k's frames play."""

    def window_samples(self, spec) -> int:
        """Samples of the speech window the audio encoder sees for one step."""

    def audio_window(self, spec, speech: torch.Tensor, k: int) -> torch.Tensor:
        """Step k's audio encoder input from the session's speech."""

    def encode_audio(self, side, spec, window: torch.Tensor, k: int) -> torch.Tensor:
        """Step k's audio features from its encoder window (`audio_window`'s shape)."""

    def lookahead_samples(self, spec) -> int:
        """Speech after a step's last frame that its audio window needs (live latency)."""

    def steady_audio_step(self, spec) -> int:
        """The first step whose audio encode is every later step's (its window whole): the
        step a worker's processing and capacity measures encode."""


class Side(Protocol):
    """Part 5, the side networks (audio and image encoders, decoder, text encoder): their
    state, loading and warm-up, and their graphs for ONNX export."""

    def random_side_state(self, spec, seed: int) -> dict:
        """Seeded side networks' state of the exact shapes."""

    def check_side(self, spec, side: dict, where: str) -> None:
        """One line naming a side tensor of the wrong name or shape."""

    def load_side(self, cfg, side: dict, device):
        """The side networks of an EngineConfig over a side state, on `device`, their
        implementation chosen once by the config's switches."""

    def warm_up_side(self, side, spec, device) -> None:
        """One call of each side network at the shapes a session runs them at."""

    def onnx_graphs(self, spec, side) -> list[OnnxGraph]:
        """The decoder and the audio encoder of loaded side networks (`load_side` on the CPU)
        as the graphs charbuild --export-onnx writes."""

    def decode_pieces(self, side, latent: torch.Tensor,
                      decoder=None) -> tuple[torch.Tensor, ...] | None:
        """A step's latent as the decoder calls a live session hands on one by one (None:
        decoded whole); `decoder`: the session's (session_decoder), else the side's own."""

    def session_decoder(self, side):
        """A decoder for one more session over the side networks' weights: its own causal
        state, `reset()` and call as `side.decoder`'s (many sessions, one copy of the
        weights)."""


class Bench(Protocol):
    """Part 6, what the benchmark scripts run and count (the family's `arms` module): named
    variants of an EngineConfig of the family, among them the waterfall, the paper's Figure
    2 (the plain path first, each optimization on in turn, the config as it is,
    `production`, last); a rank's random weights made fast; a step's FLOPs and its kernels'
    groups."""

    def waterfall(self) -> tuple[str, ...]:
        """The waterfall's arms in order."""

    def arm_names(self) -> tuple[str, ...]:
        """Every name `arm` takes: the waterfall's and the family's other benchmark arms."""

    def arm(self, cfg, name: str):
        """cfg as arm `name` runs it; ValueError naming the known arms for another name."""

    def arm_label(self, name: str) -> str:
        """The arm's label on a plot."""

    def numerics_ladder(self) -> tuple[str, ...]:
        """The numerics comparison's arms in order: the fp32 reference (or the family's own
        reference arm) first, each change of numerics after it, the config again last (the
        run-to-run floor)."""

    def numerics_weights(self, cfg, seed: int, device, rank: int):
        """The weights every numerics arm of TP rank `rank` runs (made once on `device`)."""

    def numerics_session(self, cfg, name: str, weights, device, rank: int):
        """An eager session of numerics arm `name` of cfg over `weights`."""

    def bench_rank(self, cfg, seed: int, device, rank: int) -> tuple[dict, dict]:
        """TP rank `rank`'s engine state and tables of random weights, made fast on `device`
        (a full-size benchmark's: not random_weights' values)."""

    def step_flops(self, cfg, rank: int) -> dict[str, float]:
        """A steady step's FLOP on TP rank `rank`: {"gemm": ..., "attention": ...}."""

    def kernel_groups(self) -> tuple[tuple[str, str], ...]:
        """(fragment of a kernel's name, its group) pairs, the first match winning: how a
        profile of a step sums its kernels."""


class Family(Shapes, Checkpoint, Rank, Speech, Side, Bench, Protocol):
    """A model family: the six parts above, each small enough to write and test on its
    own (docs/ARCHITECTURE.md shows both families' answers side by side). The builder and
    the runtime use nothing of a family but these members."""


class FamilyModules:
    """The members every family delegates to its own modules the same way (its package's
    `sidenets`, `warmup` and `weights`), for a family class to inherit: `package` names the
    family's package."""

    package: str

    def _module(self, name: str):
        return importlib.import_module(f"{self.package}.{name}")

    def param_shapes(self, spec) -> dict[str, tuple[int, ...]]:
        return self._module("weights").param_shapes(spec)

    def bench_weights(self, spec, seed: int, device) -> dict:
        return self.random_weights(spec, seed, device)

    def warm_up(self, session) -> int:
        from .stepping import warm_up

        return warm_up(session, self.step_shapes(session.cfg.model))

    def random_side_state(self, spec, seed: int) -> dict:
        return self._module("sidenets").random_side_state(spec, seed)

    def check_side(self, spec, side: dict, where: str) -> None:
        self._module("sidenets").check_side(spec, side, where)

    def load_side(self, cfg, side: dict, device="cpu"):
        return self._module("sidenets").load_side(cfg.model, side, device)

    def warm_up_side(self, side, spec, device) -> None:
        self._module("warmup").warm_up_side(side, spec, device)

    def decode_pieces(self, side, latent: torch.Tensor,
                      decoder=None) -> tuple[torch.Tensor, ...] | None:
        """A step's latent as the decoder's successive calls, in order, whose frames a live
        session hands on as each is decoded; None where the decoder takes a step whole."""
        return None

    def session_decoder(self, side):
        return self._module("sidenets").session_decoder(side)

    def steady_from(self, cfg) -> int:
        return 1  # a session's first step is measured apart

    def steady_audio_step(self, spec) -> int:
        return 1

    def fused_allreduce(self, cfg) -> FusedAllReduce | None:
        return None

    def quack_epilogues(self, cfg) -> bool:
        return False

    def onnx_graphs(self, spec, side) -> list[OnnxGraph]:
        return self._module("onnx_graphs").onnx_graphs(spec, side)

    def block_linear_params(self, spec) -> int:
        return spec.block_linear_params()

    def waterfall(self) -> tuple[str, ...]:
        return self._module("arms").waterfall()

    def arm_names(self) -> tuple[str, ...]:
        return self._module("arms").arm_names()

    def arm(self, cfg, name: str):
        return self._module("arms").arm(cfg, name)

    def arm_label(self, name: str) -> str:
        return self._module("arms").label(name)

    def numerics_ladder(self) -> tuple[str, ...]:
        return self._module("arms").numerics_ladder()

    def numerics_weights(self, cfg, seed: int, device, rank: int):
        return self._module("arms").numerics_weights(cfg, seed, device, rank)

    def numerics_session(self, cfg, name: str, weights, device, rank: int):
        return self._module("arms").numerics_session(cfg, name, weights, device, rank)

    def bench_rank(self, cfg, seed: int, device, rank: int) -> tuple[dict, dict]:
        return self._module("arms").bench_rank(cfg, seed, device, rank)

    def step_flops(self, cfg, rank: int) -> dict[str, float]:
        return self._module("arms").step_flops(cfg, rank)

    def kernel_groups(self) -> tuple[tuple[str, str], ...]:
        return self._module("arms").KERNEL_GROUPS


def family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(sorted(FAMILIES))}")
    return importlib.import_module(FAMILIES[name]).FAMILY


def family_of(cfg) -> Family:
    """The family of an EngineConfig."""
    return family(cfg.family)


def all_presets() -> dict[str, Any]:
    """Every family's presets, by name."""
    return {n: s for f in FAMILIES for n, s in family(f).presets.items()}


def preset_spec(name: str):
    presets = all_presets()
    if name not in presets:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(presets))}")
    return presets[name]
