"""The stepping machine every family runs: a `Session` that counts a session's steps on the
host, `StepGraphs` that replays a family's step from captured CUDA graphs, and `warm_up`,
the throw-away session that compiles, captures and uploads all of them before a user comes.

A family writes its step function (one step's forwards over the cache, reading only tensors
apart from its static arguments) and its `StepRule`: what the host's step count says of a
step (its static arguments, whether the FP8 calibration runs before it) and which steps
have a graph of their own. Everything else is written here once."""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Any, Protocol

import torch

from . import graph_upload


class StepRule(Protocol):
    """A family's phase rule: what its session does at step k, known from the host's count
    alone (never read from the device)."""

    # steps a warm-up may take before its graphs exist (its steady step plus slack)
    warm_up_limit: int
    # the first step of the steady shape (an ungraphed warm-up stops after it)
    steady_step: int
    # whether steps replay from graphs at all under this config
    graphed: bool

    def start(self, model, cache, reference: torch.Tensor, prompt: torch.Tensor) -> None:
        """The session's start: the reference latent and prompt features into the model."""

    def before(self, cache, k: int) -> None:
        """What runs eagerly before step k (the FP8 calibration at its step)."""

    def kind(self, k: int) -> dict[str, Any]:
        """Step k's static arguments (keywords of the family's step function)."""

    def resets_at(self, cache, k: int) -> bool:
        """Whether step k's positions start again from the reset (the positions of a long
        session stay bounded: a benchmark counts these)."""

    def graph_key(self, cache, kind: dict) -> Hashable | None:
        """The graph a step of `kind` replays (None: it runs eagerly)."""

    def captures_at(self, cache, kind: dict) -> bool:
        """Whether a step of `kind` is the first steady one, after which graphs are made."""

    def captures(self, cache, kind: dict) -> Iterator[tuple[Hashable, dict]]:
        """After that step: (key, static arguments) of each graph to capture, the cache's
        host-side phase set as each runs (capturing records kernels without running
        them: the session's state is unchanged)."""


class Session:
    """Drives one rank's model and cache through a session: the host-side step count that
    picks each step's kind, the eager work before a step, the step function (the family's
    eager step, or StepGraphs over it, or another of its signature).

    The model holds the weights and no session's state; the cache holds all of a session's
    (its K/V, positions, counters and conditioning). `sibling()` is another session over the
    same model with a cache of its own, so one copy of the weights serves many sessions."""

    def __init__(self, model, cache, rule: StepRule, step_fn, device, new_cache=None,
                 graph_step=None):
        """`new_cache()`: a fresh cache for a sibling; `graph_step`: the family's eager step
        a sibling's StepGraphs wraps (None: siblings step through `step_fn` itself)."""
        self.model, self.cache, self.rule, self.step_fn = model, cache, rule, step_fn
        self.cfg = model.cfg
        self.device = torch.device(device)
        self.new_cache, self.graph_step = new_cache, graph_step
        self.k = 0  # host-side step count: picks the step's kind, never read from the device

    def sibling(self) -> Session:
        """A session of its own (cache, step count, graphs) over this one's model."""
        if self.new_cache is None:
            raise TypeError("this session was made without a cache factory")
        step_fn = StepGraphs(self.graph_step, self.rule, self.device) \
            if self.graph_step is not None else self.step_fn
        return Session(self.model, self.new_cache(), self.rule, step_fn, self.device,
                       self.new_cache, self.graph_step)

    def start(self, reference: torch.Tensor, prompt: torch.Tensor) -> None:
        """A new session: the reference latent and the prompt's features."""
        self.cache.new_session()
        self.k = 0
        self.rule.start(self.model, self.cache, reference, prompt)

    def step(self, noise: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        self.rule.before(self.cache, self.k)
        out = self.step_fn(self.model, self.cache, noise, audio, **self.rule.kind(self.k))
        self.k += 1
        return out


class StepGraphs:
    """A family's step replayed from captured CUDA graphs, one per key its rule names. The
    first steady step of a process runs eagerly (kernels load, workspaces are made) and
    every graph is captured after it; inputs are copied into static buffers, and what a step
    needs of the session's position lives on the device, so a replay needs no host state."""

    def __init__(self, step, rule: StepRule, device):
        self.step, self.rule, self.device = step, rule, torch.device(device)
        self.graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[Hashable, torch.Tensor] = {}
        self.noise = self.audio = None
        self.pool = None

    def ready(self) -> bool:
        return bool(self.graphs)

    def upload(self) -> None:
        """Upload every captured graph to the device (graph_upload), so that each one's
        first replay starts as fast as the later ones."""
        lib, stream = graph_upload.cudart(), torch.cuda.current_stream()
        for g in self.graphs.values():
            graph_upload.upload(lib, g, stream)

    def __call__(self, model, cache, noise, audio, **kind):
        key = self.rule.graph_key(cache, kind)
        if key is not None and key in self.graphs:
            self.noise.copy_(noise)
            self.audio.copy_(audio)
            self.graphs[key].replay()
            return self.outputs[key].clone()
        if key is None or self.graphs or not self.rule.captures_at(cache, kind):
            return self.step(model, cache, noise, audio, **kind)
        self.noise = noise.to(self.device).clone()
        self.audio = audio.to(self.device).clone()
        out = self.step(model, cache, noise, audio, **kind)
        torch.cuda.synchronize()
        self.pool = torch.cuda.graph_pool_handle()
        for k, static in self.rule.captures(cache, kind):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self.outputs[k] = self.step(model, cache, self.noise, self.audio, **static)
            self.graphs[k] = g
        return out


def session_of(model, new_cache, rule: StepRule, step, device, graphed: bool,
               step_fn=None) -> Session:
    """A rank's session over a cache from `new_cache()`: its steps through `step_fn` if
    given, else StepGraphs over the family's `step` where `graphed`, else `step` itself."""
    graph_step = step if step_fn is None and graphed else None
    if step_fn is None:
        step_fn = StepGraphs(step, rule, device) if graphed else step
    return Session(model, new_cache(), rule, step_fn, device, new_cache, graph_step)


def warm_up(session: Session, shapes, seed: int = 0) -> int:
    """Run seeded random inputs of the family's hand-off shapes (`shapes`: its StepShapes)
    through `session` until its graphs are captured (where the rule graphs nothing: through
    its first steady step), then upload every graph to the device, so that nothing is left
    to compile, capture or upload when a user arrives. Returns the steps run. The next
    session's start resets every cache and counter; the graphs stay valid (they read the
    same buffers)."""
    graphed, rule = session.step_fn, session.rule
    if not isinstance(graphed, StepGraphs):
        raise TypeError("warm_up needs a session stepping through StepGraphs")
    dev = session.device
    g = torch.Generator(device=dev).manual_seed(seed)

    def rand(shape):
        return torch.randn(shape, generator=g, device=dev)

    with torch.inference_mode():
        session.start(rand(shapes.reference), rand(shapes.prompt))
        for k in range(rule.warm_up_limit):
            session.step(rand(shapes.noise_shape), rand(shapes.features))
            if graphed.ready() or (not rule.graphed and k + 1 >= rule.steady_step):
                break
        if graphed.ready():
            # a graph's first launch would upload it to the device: uploaded now, a user's
            # first steps do not pay for that (in place of replaying every graph once)
            graphed.upload()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    if rule.graphed and not graphed.ready():
        raise RuntimeError(f"warm-up reached no steady step in {rule.warm_up_limit} steps")
    return k + 1
