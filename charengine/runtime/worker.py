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

import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch

from charengine.assemble import rank_session
from charengine.family import family_of
from charengine.mapping import Mapping
from charengine.timing import DeviceSpan

from .engine import Engine, EngineError
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
                 engine_kernels: bool = True):
        """`rank_slice`: run one TP rank of a TP engine alone on the first device, its
        all-reduce left out (a benchmark of one rank's work; its frames are not the model's).
        `engine_kernels=False` ignores the engine's compiled kernels and compiles every one
        at start, as a JIT worker does (the start-up benchmark's comparison)."""
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
        # diffusion where they share its GPU
        self.side_stream = torch.cuda.Stream(self.decoder_device) \
            if self.decoder_device.type == "cuda" else None
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
        self.startup = {"load_s": t1 - t0, "warm_up_s": time.perf_counter() - t1,
                        "warm_up_steps": steps, "processing_s": self.processing_s,
                        "parts": parts | side_parts}

    def on_side_stream(self, fn, *inputs, after=None, timed: bool = False):
        """fn(*inputs) on the side stream, after the event `after` (else, where an input is on
        the GPU, after the work queued so far on the current stream, which made it). The
        result is complete on return, and a GPU result is the current stream's own copy (the
        side stream's memory may be reused at once). `timed`: the result as Timed, with the
        busy time of fn's work (pipeline.Timed)."""
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
        window = self.family.audio_window(
            self.spec, torch.zeros(self.family.window_samples(self.spec)), 1)
        noise = torch.randn(shapes.noise_shape, generator=g)

        def first_piece(latent):
            pieces = self.family.decode_pieces(self.side, latent) or (latent,)
            return self._decode(pieces[0])

        self.side.decoder.reset()
        first_piece(torch.randn(shapes.latent, generator=g))  # a session's first decodes more
        t0 = time.perf_counter()
        feats = self._encode_window(window, 1)
        first_piece(self.session.step(noise.to(self.device), feats.to(self.device)))
        took = time.perf_counter() - t0
        self.side.decoder.reset()
        return took

    def _encode_window(self, window: torch.Tensor, i: int, timed: bool = False):
        """Step i's audio features from its encoder window, on the side stream (`timed`: as
        Timed, with the encoder's busy time)."""
        return self.on_side_stream(lambda x: self.family.encode_audio(
            self.side, self.spec, x.to(self.decoder_device), i), window, timed=timed)

    def _decode(self, latent: torch.Tensor, after=None, timed: bool = False):
        """The decoder's frames of `latent` on the host, decoded on the side stream after
        the event `after` (on_side_stream; `timed`: as Timed, with the decoder's busy
        time)."""
        return self.on_side_stream(
            lambda x: self.side.decoder(x.to(self.decoder_device)).cpu(), latent, after=after,
            timed=timed)

    @property
    def compiles(self) -> int:
        """Kernels compiled (and torch.compile graphs made) since this worker started."""
        return self.kernels.compiles if self.kernels is not None else 0

    def close(self) -> None:
        """Release the kernel cache (a DistributedWorker stops its rank processes here)."""
        if self.kernels is not None:
            self.kernels.close()
            self.kernels = None

    @torch.inference_mode()
    def start(self, image: torch.Tensor, prompt: str) -> None:
        """New session: encode the reference image and prompt into the global slots."""
        ref = self.side.image_encoder(image.to(self.decoder_device))
        text = self.side.text_encoder(prompt)
        self.session.start(ref.to(self.device), text.to(self.device))
        self.side.decoder.reset()

    def pipeline(self, encode_audio, seed: int = 0) -> Pipeline:
        """The three-stage pipeline over this worker's session, with rank 0's audio encoding
        given by `encode_audio(i)`."""
        # Noise from a seeded CPU generator, as every TP rank makes it: a seed gives the same
        # noise on any device and layout (CUDA generators' streams differ from the CPU's).
        g = torch.Generator().manual_seed(seed)
        shape = self.family.step_shapes(self.spec).noise_shape

        def diffuse(i, feats):
            noise = torch.randn(shape, generator=g).to(self.device)
            span = DeviceSpan(self.device)
            latent = self.session.step(noise, feats.to(self.device))
            # the step's busy time; the decoder waits for its end (span.done): this step
            # only, not the next one's work
            return Timed(latent, span.end())

        # a decoder that streams latent by latent (LiveTalk's) gives a live session each
        # latent's frames as they are decoded, and a render the frames of those same calls
        # together (its memory is one piece's, and warm-up runs the pieces' shapes alone);
        # another decodes each step whole
        latent_shape = self.family.step_shapes(self.spec).latent
        streams = self.family.decode_pieces(
            self.side, torch.empty(latent_shape, device="meta")) is not None

        def decode_pieces(item: Timed):
            for part in self.family.decode_pieces(self.side, item.value):
                yield self._decode(part, after=item.span.done, timed=True)

        def decode(item: Timed):
            if streams:
                pieces = list(decode_pieces(item))
                return Timed(torch.cat([p.value for p in pieces]),
                             sum(p.span.seconds(wait=True) for p in pieces))
            return self._decode(item.value, after=item.span.done, timed=True)

        return Pipeline(encode_audio, diffuse, decode,
                        decode_pieces=decode_pieces if streams else None)

    def run(self, speech: torch.Tensor, steps: int, sink, seed: int = 0) -> StepTimes:
        """Generate `steps` latents for `speech` (16 kHz mono) and hand each step's frames to
        `sink(i, frames)`."""
        def encode_audio(i):
            # the window cut on the host: no wait
            return self._encode_window(self.family.audio_window(self.spec, speech, i), i,
                                       timed=True)

        return self.pipeline(encode_audio, seed).run(steps, sink)
