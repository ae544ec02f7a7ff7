"""A worker holding one loaded engine (TP-1, in this process): it starts sessions from a
reference image, a prompt and speech, and runs them through the pipeline.

On a GPU the worker is ready only when nothing is left to compile or capture: the engine's
compiled kernels are loaded, a warm-up session has run every code path, and the steady and
reset step graphs are captured (`startup` says what each part took and `compiles` counts
what had to be compiled, zero for an engine with its kernels). The side networks load on a
thread of their own beside the DiT's weights (their file read straight onto their device,
their modules made without initialization: sidenets' load_side), and `startup["parts"]`
times each part of the load (seconds, wall) and, on a GPU, gives the allocator's peak after
each (`peak_mb_after_*`)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace

import torch

from charengine.assemble import rank_session
from charengine.family import family_of
from charengine.mapping import Mapping
from charengine.stepping import Together
from charengine.timing import DeviceSpan, median

from .engine import Engine, EngineError
from .lanes import CAPACITY_STEPS, Capacity, Lane, Turns
from .run_config import AUTO
from .pipeline import Pipeline, StepTimes, Timed


@contextmanager
def timed(parts: dict | None, name: str):
    """Add the seconds (wall) of the block to parts[name] (nothing where parts is None)."""
    t0 = time.perf_counter()
    yield
    if parts is not None:
        parts[name] = parts.get(name, 0.0) + time.perf_counter() - t0


def peak_mb(device: torch.device) -> float | None:
    """The most GPU memory the process's allocator has held on `device` so far (MB; None off
    a GPU): read after each part of the start, the part where it grows is where the peak
    lies (parts on two threads share one figure)."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / (1 << 20)


def load_rank(engine: Engine, mapping: Mapping, exchange=None, parts: dict | None = None):
    """TP rank `mapping.rank`'s session on `mapping.device`, weights read straight onto it,
    with the engine's tables and (on a GPU) its GEMM plan; on a GPU its steps replay captured
    graphs (warm_up captures them). `exchange`: the TP group's fused GEMM + all-reduce.
    `parts` gets the seconds of reading the weights, the tables and assembling the rank."""
    device = mapping.torch_device
    with timed(parts, "rank_weights_s"):
        state = engine.rank_state(mapping.rank, device)
    with timed(parts, "tables_s"):
        tables = engine.tables(device)
    with timed(parts, "assemble_s"):
        return rank_session(engine.config, state, mapping, tables=tables, exchange=exchange,
                            gemm_plan=engine.gemm_plan(mapping.rank) if device.type == "cuda"
                            else None)


def load_side(engine: Engine, family, device: torch.device, parts: dict):
    """The engine's side networks on `device`: the file read straight onto it, the family's
    modules over those tensors, and on a GPU one call of each (warm_up_side); what each took
    goes to `parts`."""
    with timed(parts, "side_read_s"):
        state = engine.side_state(device)
    with timed(parts, "side_build_s"):
        side = family.load_side(engine.config, state, device)
    if device.type == "cuda":
        parts["peak_mb_after_side_build"] = peak_mb(device)
        with timed(parts, "warm_up_side_s"):
            family.warm_up_side(side, engine.config.model, device)
        parts["peak_mb_after_side_warm_up"] = peak_mb(device)
    return side


class Worker:
    def __init__(self, engine: Engine, rank_slice: int | None = None,
                 engine_kernels: bool = True, sessions: int | str = 1,
                 over_capacity: bool = False, batch: int = 1):
        """`rank_slice`: run one TP rank of a TP engine alone on the first device, its
        all-reduce left out (a benchmark of one rank's work; its frames are not the model's).
        `engine_kernels=False` ignores the engine's compiled kernels and compiles every one
        at start, as a JIT worker does (the start-up benchmark's comparison). `sessions`:
        the lanes (runtime/lanes.py) this worker serves at once over one copy of the
        engine, each warmed up at start; more than one (or AUTO) measures what the devices
        hold in real time first (`capacity`) and refuses a number past it, unless
        `over_capacity` (sessions that then play below real time when all are busy).
        `batch`: the most sessions' steps run as one batch when they wait together
        (stepping.Together; on a GPU its graphs are captured here); 1, each step alone."""
        t0 = time.perf_counter()
        cfg = self.cfg = engine.config
        self.target = engine.target  # what the page and /status name
        self.family = family_of(cfg)
        if rank_slice is None:
            if cfg.tp != 1:
                raise EngineError(f"engine {engine.target.name} is TP-{cfg.tp}: this charrun "
                                  "runs TP-1 engines in one process")
            mapping = engine.target.mapping(0)
        else:  # one rank alone on the decoder's device, its all-reduce left out
            mapping = engine.target.mapping(rank_slice).slice_alone(
                engine.target.mapping(0).decoder_device)
        self.device = mapping.torch_device
        self.decoder_device = torch.device(mapping.decoder_device)
        parts, side_parts = {}, {}
        with timed(parts, "kernel_cache_s"):
            self.kernels = engine.kernel_cache(engine_kernels).activate() \
                if self.device.type == "cuda" else None
        self.spec = cfg.model
        with engine.verifying():
            # the side networks on their own thread: their read, their modules (and the
            # imports those need) and their warm-up overlap the DiT's read and assembly; it
            # is joined before the DiT's warm-up, whose graph capture must see no other
            # thread's CUDA calls
            pool = ThreadPoolExecutor(1, thread_name_prefix="side-networks")
            side = pool.submit(load_side, engine, self.family, self.decoder_device, side_parts)
            pool.shutdown(wait=False)
            self.session = load_rank(engine, mapping, parts=parts)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                parts["peak_mb_after_dit_load"] = peak_mb(self.device)
            with timed(parts, "side_wait_s"):
                self.side = side.result()
            with timed(parts, "verify_wait_s"):
                engine.verified()
        # the side networks' own stream on a GPU: decoding and audio encoding overlap the
        # diffusion where they share its GPU; one session's call on it at a time
        self.side_stream = torch.cuda.Stream(self.decoder_device) \
            if self.decoder_device.type == "cuda" else None
        self.side_lock = threading.RLock()
        # the sessions: the first over the loaded session and the side's own decoder, the
        # others siblings with caches and decoder states of their own; their steps take
        # turns on the device
        self.turns = Turns()
        self.lanes = [Lane(self, 0, self.session, self.side.decoder)]
        if batch > 1 and self.session.batch_step is None:
            raise EngineError(f"--batch {batch}: the {cfg.family} family steps each session "
                              "alone; give --batch 1")
        t1 = time.perf_counter()
        steps = 0
        # a steady step's processing time (time_processing), measured where the worker warms
        # up; a live session's first deadlines use it
        self.processing_s: float | None = None
        if self.device.type == "cuda":
            steps = self.family.warm_up(self.session)
            parts["peak_mb_after_dit_warm_up"] = peak_mb(self.device)
            with timed(parts, "time_processing_s"):
                self.processing_s = self.time_processing()
            parts["peak_mb_after_time_processing"] = peak_mb(self.device)
        # batched steps: their staging caches, and on a GPU a graph per batch size
        self.together = None
        if batch > 1:
            self.together = Together(self.session, batch)
            if self.device.type == "cuda":
                with timed(parts, "batch_capture_s"):
                    self.together.capture(self.session, self.family.step_shapes(self.spec))
                parts["peak_mb_after_batch_capture"] = peak_mb(self.device)
            self.turns.together = self.together
        # more sessions than one: how many this device holds in real time, measured here,
        # decides `auto` and refuses a number it cannot hold
        self.capacity: Capacity | None = None
        if sessions != 1:
            with timed(parts, "capacity_s"):
                self.capacity = self.measure_capacity()
            n = self.capacity.sessions if sessions == AUTO else sessions
            if n > self.capacity.sessions and not over_capacity:
                raise EngineError(f"--sessions {n}: {self.capacity.describe()}; give "
                                  f"--sessions {max(1, self.capacity.sessions)} or fewer, or "
                                  f"--sessions {AUTO}")
            for i in range(1, max(1, n)):
                self.lanes.append(Lane(self, i, self.session.sibling(),
                                       self.family.session_decoder(self.side)))
                if self.device.type == "cuda":  # its graphs captured before a user arrives
                    self.family.warm_up(self.lanes[-1].session)
            if self.device.type == "cuda":
                parts["peak_mb_after_lanes"] = peak_mb(self.device)
        self.startup = {"load_s": t1 - t0, "warm_up_s": time.perf_counter() - t1,
                        "warm_up_steps": steps, "processing_s": self.processing_s,
                        "sessions": len(self.lanes),
                        "batch": self.together.most if self.together else 1,
                        "capacity": self.capacity.to_dict() if self.capacity else None,
                        "parts": parts | side_parts}

    def on_side_stream(self, fn, *inputs, after=None, timed: bool = False):
        """fn(*inputs) on the side stream, after the event `after` (else, where an input is on
        the GPU, after the work queued so far on the current stream, which made it). The
        result is complete on return, and a GPU result is the current stream's own copy (the
        side stream's memory may be reused at once). `timed`: the result as Timed, with the
        busy time of fn's work (pipeline.Timed)."""
        with self.side_lock:
            return self._on_side_stream(fn, *inputs, after=after, timed=timed)

    def _on_side_stream(self, fn, *inputs, after=None, timed: bool = False):
        if self.side_stream is None:
            span = DeviceSpan(self.decoder_device)
            out = fn(*inputs)
            return Timed(out, span.end()) if timed else out
        if after is not None:
            self.side_stream.wait_event(after)
        elif any(isinstance(x, torch.Tensor) and x.is_cuda for x in inputs):
            self.side_stream.wait_stream(torch.cuda.current_stream(self.decoder_device))
        with torch.cuda.stream(self.side_stream):
            for x in inputs:
                if isinstance(x, torch.Tensor) and x.is_cuda:
                    x.record_stream(self.side_stream)
            # begins once `after` has been waited for
            span = DeviceSpan(self.decoder_device) if timed else None
            out = fn(*inputs)
            if span is not None:
                span.end()
        self.side_stream.synchronize()
        out = out.clone() if isinstance(out, torch.Tensor) and out.is_cuda else out
        return Timed(out, span) if timed else out

    @torch.inference_mode()
    def time_processing(self, seed: int = 0) -> float:
        """Seconds from a steady step's audio take to its first frames, its stages one after
        the other as a live step runs them: the encode of a step's audio window, the step
        (a graph replay on a GPU) and the decoder's first call on its latent (the first piece
        where the decoder streams), the decoder's state mid-session. Run on a session at its
        steady point (where the warm-up leaves it; a session's start resets what it changes).
        A live session's deadlines use it until its own steps have been measured."""
        g = torch.Generator().manual_seed(seed)
        shapes = self.family.step_shapes(self.spec)
        noise = torch.randn(shapes.noise_shape, generator=g)
        lane = self.lanes[0]
        window, k_audio = lane.steady_window()

        def first_piece(latent):
            pieces = lane.pieces(latent) or (latent,)
            return lane.decode(pieces[0])

        self.side.decoder.reset()
        first_piece(torch.randn(shapes.latent, generator=g))  # a session's first decodes more
        t0 = time.perf_counter()
        feats = lane.encode_window(window, k_audio)
        first_piece(self.session.step(noise.to(self.device), feats.to(self.device)))
        took = time.perf_counter() - t0
        self.side.decoder.reset()
        return took

    @torch.inference_mode()
    def measure_capacity(self, steps: int = CAPACITY_STEPS, seed: int = 0) -> Capacity:
        """How many sessions this worker's devices hold in real time (Lane.measure_capacity on
        the first lane, its diffusion timed on this device) and, with batches, one batched
        step of the most it takes on this device. The lane's session is left as a session's
        start will reset it."""
        lane = self.lanes[0]
        g = torch.Generator().manual_seed(seed)
        shape = self.family.step_shapes(self.spec).noise_shape

        def step(feats):
            noise = torch.randn(shape, generator=g).to(self.device)
            span = DeviceSpan(self.device)
            latent = self.session.step(noise, feats.to(self.device))
            return Timed(latent, span.end())

        lane.start(torch.zeros(3, self.spec.out_h, self.spec.out_w), "")
        capacity = lane.measure_capacity(step, steps, self.decoder_device == self.device)
        if self.together is None:
            return capacity
        most = self.together.most  # a batch of the most it takes, each place this step
        window, k_audio = lane.steady_window()
        feats = lane.encode_window(window, k_audio).to(self.device)
        batches = []
        for _ in range(steps):
            noise = [torch.randn(shape, generator=g).to(self.device) for _ in range(most)]
            span = DeviceSpan(self.device)
            self.together.rehearse(self.session, noise, [feats] * most)  # copies too
            batches.append(span.end().seconds(wait=True))
        return replace(capacity, batch=most, batch_s=median(batches))

    @property
    def compiles(self) -> int:
        """Kernels compiled (and torch.compile graphs made) since this worker started."""
        return self.kernels.compiles if self.kernels is not None else 0

    def close(self) -> None:
        """Release the kernel cache (a DistributedWorker stops its rank processes here)."""
        if self.kernels is not None:
            self.kernels.close()
            self.kernels = None

    def start(self, image: torch.Tensor, prompt: str) -> None:
        """New session on the first lane (what a worker of one session runs)."""
        self.lanes[0].start(image, prompt)

    def pipeline(self, encode_audio, seed: int = 0) -> Pipeline:
        """The first lane's pipeline (Lane.pipeline)."""
        return self.lanes[0].pipeline(encode_audio, seed)

    def run(self, speech: torch.Tensor, steps: int, sink, seed: int = 0) -> StepTimes:
        """The first lane's render of `speech` (Lane.run)."""
        return self.lanes[0].run(speech, steps, sink, seed)
