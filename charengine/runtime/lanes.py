"""Many sessions in one worker: each a `Lane` (its own DiT session over the worker's one
model, its own decoder state, its own pipeline), the GPU shared between them by `Turns`.

A lane is what a LiveSession or a render drives: it has the worker's interface for one
session (`start`, `pipeline`, `run`, the spec and family, the side networks' stream). The
weights, tables, kernels and side networks are the worker's, once; what a session changes
(its caches, step count, graphs, decoder state, noise) is the lane's, so nothing one session
does reaches another.

`Turns` gives the steps of all lanes to the device one at a time, the earliest deadline
first: a lane asks for its turn with the step's deadline and runs its step (on a GPU: queues
its graph's replay) when no step with an earlier deadline waits. A step that names no
deadline is due when it asks (so equal budgets make it first come, first served). With a
worker's `batch` above one, the steps that wait when the device frees run as one batch
(stepping.Together: their tokens stacked through the GEMMs, each attending over its own
cache): under load the sessions step together, and a step that finds the device free runs
alone at once."""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from charengine.timing import DeviceSpan, median

from .pipeline import Pipeline, StepTimes, Timed

CAPACITY_STEPS = 5  # steady steps timed to measure a worker's capacity
# the share of a step's budget the sessions' busy time on a device may fill: the rest
# absorbs a session's first steps, its resets and the jitter of the host
REALTIME_MARGIN = 0.2


@dataclass(frozen=True)
class Capacity:
    """What one steady step of one session costs each device (busy seconds: the diffusion
    on the DiT's, the audio encode and the decode on the decoder's), the step's real-time
    budget, whether the two devices are one, and so how many sessions fit in the budget less
    REALTIME_MARGIN. With batches (`batch` above one), `batch_s` is one batched step of that
    many sessions on the DiT's device, and a session's diffusion costs the lesser of its
    step alone and its share of the batch."""

    diffusion_s: float
    side_s: float
    budget_s: float
    shared_device: bool
    target: str
    batch: int = 1
    batch_s: float | None = None

    @property
    def session_diffusion_s(self) -> float:
        """A session's diffusion a step: alone, or its share of a batch where that is less."""
        if self.batch_s is None:
            return self.diffusion_s
        return min(self.diffusion_s, self.batch_s / self.batch)

    @property
    def per_step_s(self) -> float:
        """The busiest device's time a step: both parts where they share it."""
        if self.shared_device:
            return self.session_diffusion_s + self.side_s
        return max(self.session_diffusion_s, self.side_s)

    @property
    def sessions(self) -> int:
        return int(self.budget_s * (1 - REALTIME_MARGIN) // self.per_step_s)

    def describe(self) -> str:
        batched = "" if self.batch_s is None else \
            (f"; its diffusion {self.session_diffusion_s * 1e3:.1f} ms in batches of "
             f"{self.batch}, {self.diffusion_s * 1e3:.1f} ms alone")
        return (f"this machine holds {self.sessions} real-time session"
                f"{'' if self.sessions == 1 else 's'} of {self.target} (a step's time on its "
                f"busiest device {self.per_step_s * 1e3:.1f} ms of its "
                f"{self.budget_s * 1e3:.1f} ms, {REALTIME_MARGIN:.0%} kept free{batched})")

    def to_dict(self) -> dict:
        return {"diffusion_s": self.diffusion_s, "side_s": self.side_s,
                "budget_s": self.budget_s, "shared_device": self.shared_device,
                "batch": self.batch, "batch_s": self.batch_s,
                "per_step_s": self.per_step_s, "sessions": self.sessions,
                "margin": REALTIME_MARGIN}


@dataclass(eq=False)
class Request:
    """One step waiting for the device: `order` (deadline, arrival) places it in the queue;
    `session` and its inputs where it may join a batch (None: a turn of its own)."""

    order: tuple[float, int]
    session: object = None
    noise: torch.Tensor | None = None
    audio: torch.Tensor | None = None
    result: object = None
    error: BaseException | None = None
    done: bool = False

    def __lt__(self, other: Request) -> bool:
        return self.order < other.order


class Turns:
    """One step at a time across a worker's lanes, earliest deadline first; with `together`
    (stepping.Together), the steps that wait when the device frees and may join a batch run
    as one, up to its `most`: the earliest leads, the others with the earliest deadlines
    after it join. A step that asks while the device is free runs at once, alone."""

    def __init__(self, together=None):
        self._cond = threading.Condition()
        self._waiting: list[Request] = []  # a heap by order
        self._arrivals = itertools.count()
        self._busy = False
        self.together = together
        self.taken = 0  # steps run so far (all lanes)
        self.batches = 0  # of them, the batches of more than one step

    @property
    def waiting(self) -> int:
        """Steps waiting for their turn."""
        with self._cond:
            return len(self._waiting)

    def _queue(self, req: Request) -> bool:
        """Wait for `req`'s turn; True when its caller runs it (and whatever joined it),
        False when it ran in another's batch."""
        with self._cond:
            heapq.heappush(self._waiting, req)
            while not req.done and (self._busy or self._waiting[0] is not req):
                self._cond.wait()
            if req.done:
                return False
            heapq.heappop(self._waiting)
            self._busy = True
            return True

    def _release(self, steps: int) -> None:
        with self._cond:
            self._busy = False
            self.taken += steps
            self.batches += steps > 1
            self._cond.notify_all()

    def _order(self, deadline: float | None) -> tuple[float, int]:
        return (time.monotonic() if deadline is None else deadline, next(self._arrivals))

    @contextmanager
    def turn(self, deadline: float | None = None):
        """Hold the device for one step: waits while another step runs or one with an
        earlier deadline (time.monotonic() seconds; None: now) waits."""
        self._queue(Request(self._order(deadline)))
        try:
            yield
        finally:
            self._release(1)

    def _joiners(self, lead: Request) -> list[Request]:
        """The waiting steps that join `lead`'s batch, earliest deadline first (taken off
        the queue)."""
        if self.together is None or lead.session.batch_kind() is None:
            return []
        with self._cond:
            fit = sorted(r for r in self._waiting
                         if r.session is not None and r.session.batch_kind() is not None)
            joined = fit[: self.together.most - 1]
            if joined:
                self._waiting = [r for r in self._waiting if r not in joined]
                heapq.heapify(self._waiting)
        return joined

    def step(self, session, noise: torch.Tensor, audio: torch.Tensor,
             deadline: float | None = None):
        """`session`'s next step in its turn, alone or in a batch: (its latent, the busy
        span of the step or of the batch it ran in)."""
        req = Request(self._order(deadline), session, noise, audio)
        if not self._queue(req):
            if req.error is not None:
                raise req.error
            return req.result
        batch = [req, *self._joiners(req)]
        try:
            span = DeviceSpan(session.device)
            if len(batch) == 1:
                outs = [session.step(noise, audio)]
            else:
                outs = self.together([r.session for r in batch], [r.noise for r in batch],
                                     [r.audio for r in batch])
            span.end()
            for r, out in zip(batch, outs):
                r.result = (out, span)
        except BaseException as e:
            for r in batch:
                r.error = e
            raise
        finally:
            with self._cond:
                for r in batch[1:]:
                    r.done = True
            self._release(len(batch))
        return req.result


class Lane:
    """One session's place in a worker: `session` (the family's Session over the worker's
    model) and `decoder` (its decoder state over the side networks' weights)."""

    def __init__(self, worker, index: int, session, decoder):
        self.worker, self.index, self.session, self.decoder = worker, index, session, decoder
        self.spec, self.family, self.cfg = worker.spec, worker.family, worker.cfg
        self.target, self.side = worker.target, worker.side
        self.device, self.decoder_device = worker.device, worker.decoder_device

    @property
    def processing_s(self) -> float | None:
        return self.worker.processing_s

    def on_side_stream(self, fn, *inputs, after=None, timed: bool = False):
        return self.worker.on_side_stream(fn, *inputs, after=after, timed=timed)

    def encode_window(self, window: torch.Tensor, i: int, timed: bool = False):
        """Step i's audio features from its encoder window, on the side stream (`timed`: as
        Timed, with the encoder's busy time)."""
        return self.on_side_stream(lambda x: self.family.encode_audio(
            self.side, self.spec, x.to(self.decoder_device), i), window, timed=timed)

    def decode(self, latent: torch.Tensor, after=None, timed: bool = False):
        """This lane's decoder's frames of `latent` on the host, decoded on the side
        stream after the event `after` (`timed`: as Timed, with the decoder's busy time)."""
        return self.on_side_stream(
            lambda x: self.decoder(x.to(self.decoder_device)).cpu(), latent, after=after,
            timed=timed)

    def pieces(self, latent: torch.Tensor):
        """The step's latent as this lane's decoder calls (None: decoded whole)."""
        return self.family.decode_pieces(self.side, latent, self.decoder)

    def steady_window(self) -> tuple[torch.Tensor, int]:
        """A steady step's index and its audio window of silence: what the measures of a
        step's cost (processing time, capacity) encode."""
        k_audio = self.family.steady_audio_step(self.spec)
        silence = torch.zeros(self.family.window_samples(self.spec))
        return self.family.audio_window(self.spec, silence, k_audio), k_audio

    @torch.inference_mode()
    def measure_capacity(self, step, steps: int, shared_device: bool) -> Capacity:
        """What one steady step of this lane's session costs each device, against the step's
        budget (its frames at the engine's fps): medians over `steps` steps after the ones
        before the steady point (every step encoded, stepped and decoded as a live one is),
        the diffusion's busy time as `step(feats) -> Timed` reports it (the worker's own
        way to the session: a DeviceSpan here, the TP ranks' seconds there) and the audio
        encode and the step's whole decode on the decoder's device. The session is started
        by the caller; its decoder is left reset, as a session's start leaves it."""
        window, k_audio = self.steady_window()
        warm = self.family.steady_from(self.cfg)
        diffusion, side = [], []
        for k in range(warm + steps):
            feats = self.encode_window(window, k_audio, timed=True)
            out = step(feats.value)
            pieces = self.pieces(out.value) or (out.value,)
            decoded = [self.decode(p, after=out.done, timed=True) for p in pieces]
            if k >= warm:
                diffusion.append(out.seconds(wait=True))
                side.append(feats.seconds(wait=True) +
                            sum(d.seconds(wait=True) for d in decoded))
        self.decoder.reset()
        budget = self.family.step_frames(self.spec, 1) / self.spec.fps
        return Capacity(median(diffusion), median(side), budget, shared_device,
                        self.target.name)

    @torch.inference_mode()
    def start(self, image: torch.Tensor, prompt: str) -> None:
        """New session: encode the reference image and prompt into this lane's caches."""
        with self.worker.side_lock:
            ref = self.side.image_encoder(image.to(self.decoder_device))
            text = self.side.text_encoder(prompt)
        with self.worker.turns.turn():
            self.session.start(ref.to(self.device), text.to(self.device))
        self.decoder.reset()

    def pipeline(self, encode_audio, seed: int = 0) -> Pipeline:
        """The three-stage pipeline over this lane's session, with rank 0's audio encoding
        given by `encode_audio(i)`; its steps take their turns on the device."""
        # Noise from a seeded CPU generator, as every TP rank makes it: a seed gives the same
        # noise on any device and layout (CUDA generators' streams differ from the CPU's).
        g = torch.Generator().manual_seed(seed)
        shape = self.family.step_shapes(self.spec).noise_shape

        def diffuse(i, feats):
            noise = torch.randn(shape, generator=g).to(self.device)
            feats = feats.to(self.device)
            # the step's busy time (of the batch it ran in); the decoder waits for its end
            # (span.done): this step only, not the next one's work
            return Timed(*self.worker.turns.step(self.session, noise, feats))

        # a decoder that streams latent by latent (LiveTalk's) gives a live session each
        # latent's frames as they are decoded, and a render the frames of those same calls
        # together (its memory is one piece's, and warm-up runs the pieces' shapes alone);
        # another decodes each step whole
        latent_shape = self.family.step_shapes(self.spec).latent
        streams = self.pieces(torch.empty(latent_shape, device="meta")) is not None

        def decode_pieces(item: Timed):
            for part in self.pieces(item.value):
                yield self.decode(part, after=item.span.done, timed=True)

        def decode(item: Timed):
            if streams:
                pieces = list(decode_pieces(item))
                return Timed(torch.cat([p.value for p in pieces]),
                             sum(p.span.seconds(wait=True) for p in pieces))
            return self.decode(item.value, after=item.span.done, timed=True)

        return Pipeline(encode_audio, diffuse, decode,
                        decode_pieces=decode_pieces if streams else None)

    def run(self, speech: torch.Tensor, steps: int, sink, seed: int = 0) -> StepTimes:
        """Generate `steps` latents for `speech` (16 kHz mono) and hand each step's frames to
        `sink(i, frames)`."""
        def encode_audio(i):
            # the window cut on the host: no wait
            return self.encode_window(self.family.audio_window(self.spec, speech, i), i,
                                      timed=True)

        return self.pipeline(encode_audio, seed).run(steps, sink)
