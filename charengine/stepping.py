"""The stepping machine every family runs: a `Session` that counts a session's steps on the
host, `StepGraphs` that replays a family's step from captured CUDA graphs, and `warm_up`,
the throw-away session that compiles, captures and uploads all of them before a user comes.

A family writes its step function (one step's forwards over the cache, reading only tensors
apart from its static arguments) and its `StepRule`: what the host's step count says of a
step (its static arguments, whether the FP8 calibration runs before it) and which steps
have a graph of their own. A family that can step several sessions as one batch (their
tokens stacked through every linear, each session's attention over its own cache) also
gives that batched step and says which steps may join a batch; `Together` runs them.
Everything else is written here once."""

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

    def batch_kind(self, cache, kind: dict) -> dict | None:
        """The static arguments a step of `kind` runs with in a batch of several sessions'
        steps (all of a batch's steps run with these: the steady step's), None where it runs
        alone. Pure: what the batch's step leaves out is `before_batch`'s."""

    def before_batch(self, cache, kind: dict) -> None:
        """What runs eagerly on the session's own cache before its step of `kind` joins a
        batch (a position reset's rotation of the cached keys)."""


class Session:
    """Drives one rank's model and cache through a session: the host-side step count that
    picks each step's kind, the eager work before a step, the step function (the family's
    eager step, or StepGraphs over it, or another of its signature).

    The model holds the weights and no session's state; the cache holds all of a session's
    (its K/V, positions, counters and conditioning). `sibling()` is another session over the
    same model with a cache of its own, so one copy of the weights serves many sessions."""

    def __init__(self, model, cache, rule: StepRule, step_fn, device, new_cache=None,
                 graph_step=None, batch_step=None):
        """`new_cache()`: a fresh cache for a sibling; `graph_step`: the family's eager step
        a sibling's StepGraphs wraps (None: siblings step through `step_fn` itself);
        `batch_step`: the family's step of several sessions at once (None: it has none)."""
        self.model, self.cache, self.rule, self.step_fn = model, cache, rule, step_fn
        self.cfg = model.cfg
        self.device = torch.device(device)
        self.new_cache, self.graph_step, self.batch_step = new_cache, graph_step, batch_step
        self.k = 0  # host-side step count: picks the step's kind, never read from the device

    def sibling(self) -> Session:
        """A session of its own (cache, step count, graphs) over this one's model."""
        if self.new_cache is None:
            raise TypeError("this session was made without a cache factory")
        step_fn = StepGraphs(self.graph_step, self.rule, self.device) \
            if self.graph_step is not None else self.step_fn
        return Session(self.model, self.new_cache(), self.rule, step_fn, self.device,
                       self.new_cache, self.graph_step, self.batch_step)

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

    def batch_kind(self) -> dict | None:
        """The static arguments the next step runs with in a batch (None: it runs alone)."""
        if self.batch_step is None:
            return None
        return self.rule.batch_kind(self.cache, self.rule.kind(self.k))


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


class Together:
    """Steps of several sessions over one model computed as one batch, by the family's
    batched step over staging caches of its own: each session's cache is copied into a
    staging cache, the batch steps them all, and each is copied back. The staging caches
    are the same buffers every batch, so on a GPU each batch size's step replays a graph
    captured once (`capture`, at start-up): which sessions make up a batch changes nothing
    of it. A session's frames in a batch are its frames alone up to the roundings of the
    larger GEMMs (bitwise where those round as the smaller ones do)."""

    def __init__(self, session: Session, most: int):
        """Batches of 2 .. `most` sessions of `session`'s model."""
        if session.batch_step is None:
            raise TypeError("this family has no batched step")
        self.model, self.rule, self.step = session.model, session.rule, session.batch_step
        self.device, self.most = session.device, most
        self.staging = [session.new_cache() for _ in range(most)]
        self.noise: list[torch.Tensor] = []
        self.audio: list[torch.Tensor] = []
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, list[torch.Tensor]] = {}

    def stage(self, sessions: list[Session]) -> list:
        """Copy each session's cache into its place of the batch; returns those caches."""
        for staging, s in zip(self.staging, sessions):
            staging.copy_from(s.cache)
        return self.staging[:len(sessions)]

    def capture(self, session: Session, shapes) -> None:
        """Capture one graph per batch size (a GPU's), from `session` at its steady point
        (where warm_up leaves it): its cache staged in every place of the batch."""
        kind = session.batch_kind()
        if kind is None:
            raise RuntimeError("the session is not at a step that joins a batch")
        staged = self.stage([session] * self.most)
        self.noise = [torch.zeros(shapes.noise_shape, device=self.device)
                      for _ in range(self.most)]
        self.audio = [torch.zeros(shapes.features, device=self.device)
                      for _ in range(self.most)]
        with torch.inference_mode():
            # the kernels' first launches and workspaces outside the capture
            self.step(self.model, staged, self.noise, self.audio, [kind] * self.most)
            torch.cuda.synchronize(self.device)
            pool = torch.cuda.graph_pool_handle()
            for n in range(2, self.most + 1):
                staged = self.stage([session] * n)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    self.outputs[n] = self.step(self.model, staged, self.noise[:n],
                                                self.audio[:n], [kind] * n)
                self.graphs[n] = g
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def run(self, kinds: list[dict], noises, audios) -> list[torch.Tensor]:
        """The batch's step over the first len(kinds) staged caches (a graph's replay where
        one was captured for that many), their clean latents in order."""
        n = len(kinds)
        if n not in self.graphs:
            return self.step(self.model, self.staging[:n], noises, audios, kinds)
        for buf, x in zip(self.noise, noises):
            buf.copy_(x)
        for buf, x in zip(self.audio, audios):
            buf.copy_(x)
        self.graphs[n].replay()
        return [o.clone() for o in self.outputs[n]]

    @torch.inference_mode()
    def rehearse(self, session: Session, noises, audios) -> list[torch.Tensor]:
        """A batch of len(noises) steps as charrun runs one, every place staged from
        `session`'s cache at a step that joins a batch; nothing is copied back (what a
        benchmark or a capacity measure times, copies included)."""
        staged = len(noises)
        self.stage([session] * staged)
        return self.run([session.batch_kind()] * staged, noises, audios)

    def __call__(self, sessions: list[Session], noises, audios) -> list[torch.Tensor]:
        """One step of each session (at least two, at most `most`, every one's batch_kind
        not None), their clean latents in order."""
        n = len(sessions)
        if not 2 <= n <= self.most:
            raise ValueError(f"a batch of {n} sessions: this one takes 2 to {self.most}")
        kinds = []
        for s in sessions:
            kind = s.batch_kind()
            if kind is None:
                raise ValueError("a session's next step does not join a batch")
            s.rule.before(s.cache, s.k)
            s.rule.before_batch(s.cache, s.rule.kind(s.k))
            kinds.append(kind)
        staged = self.stage(sessions)
        outs = self.run(kinds, noises, audios)
        for s, staging in zip(sessions, staged):
            s.cache.copy_from(staging)
            s.k += 1
        return outs


def session_of(model, new_cache, rule: StepRule, step, device, graphed: bool,
               step_fn=None, batch_step=None) -> Session:
    """A rank's session over a cache from `new_cache()`: its steps through `step_fn` if
    given, else StepGraphs over the family's `step` where `graphed`, else `step` itself;
    `batch_step`, the family's step of several sessions at once (None: it has none)."""
    graph_step = step if step_fn is None and graphed else None
    if step_fn is None:
        step_fn = StepGraphs(step, rule, device) if graphed else step
    return Session(model, new_cache(), rule, step_fn, device, new_cache, graph_step,
                   batch_step)


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
