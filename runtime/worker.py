"""A worker holding one loaded engine (TP-1, in this process): it starts sessions from a
reference image, a prompt and speech, and runs them through the pipeline.

On a GPU the worker is ready only when nothing is left to compile or capture: the engine's
compiled kernels are loaded, a warm-up session has run every code path, and the steady and
reset step graphs are captured (`startup` says what each part took and `compiles` counts
what had to be compiled, zero for an engine with its kernels)."""

from __future__ import annotations

import time

import torch

from charengine.assemble import rank_session
from charengine.family import family_of
from charengine.mapping import Mapping

from .engine import Engine, EngineError
from .pipeline import Pipeline, StepTimes


def load_rank(engine: Engine, mapping: Mapping, exchange=None):
    """TP rank `mapping.rank`'s session on `mapping.device`, weights read straight onto it,
    with the engine's tables and (on a GPU) its GEMM plan; on a GPU its steps replay captured
    graphs (warm_up captures them). `exchange`: the TP group's fused GEMM + all-reduce."""
    device = mapping.torch_device
    return rank_session(engine.config, engine.rank_state(mapping.rank, device), mapping,
                        tables=engine.tables(device), exchange=exchange,
                        gemm_plan=engine.gemm_plan(mapping.rank) if device.type == "cuda"
                        else None)


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
        self.kernels = engine.kernel_cache(engine_kernels).activate() \
            if self.device.type == "cuda" else None
        self.spec = spec = cfg.model
        with engine.verifying():
            self.session = load_rank(engine, mapping)
            self.side = self.family.load_side(spec, engine.side_state(), self.decoder_device)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        t1 = time.perf_counter()
        steps = 0
        if self.device.type == "cuda":
            steps = self.family.warm_up(self.session)
            self.family.warm_up_side(self.side, spec, self.decoder_device)
        self.startup = {"load_s": t1 - t0, "warm_up_s": time.perf_counter() - t1,
                        "warm_up_steps": steps}
        # the side networks' own stream on a GPU: decoding and audio encoding overlap the
        # diffusion where they share its GPU
        self.side_stream = torch.cuda.Stream(self.decoder_device) \
            if self.decoder_device.type == "cuda" else None

    def on_side_stream(self, fn, *inputs, after=None):
        """fn(*inputs) on the side stream, after the event `after` (else, where an input is on
        the GPU, after the work queued so far on the current stream, which made it). The
        result is complete on return, and a GPU result is the current stream's own copy (the
        side stream's memory may be reused at once)."""
        if self.side_stream is None:
            return fn(*inputs)
        if after is not None:
            self.side_stream.wait_event(after)
        elif any(isinstance(x, torch.Tensor) and x.is_cuda for x in inputs):
            self.side_stream.wait_stream(torch.cuda.current_stream(self.decoder_device))
        with torch.cuda.stream(self.side_stream):
            for x in inputs:
                if isinstance(x, torch.Tensor) and x.is_cuda:
                    x.record_stream(self.side_stream)
            out = fn(*inputs)
        self.side_stream.synchronize()
        return out.clone() if isinstance(out, torch.Tensor) and out.is_cuda else out

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
            latent = self.session.step(noise, feats.to(self.device))
            if self.side_stream is None:
                return latent, None
            done = torch.cuda.Event()
            done.record()  # the decoder waits for this step only, not for the next one's work
            return latent, done

        def decode(item):
            latent, done = item
            return self.on_side_stream(
                lambda x: self.side.decoder(x.to(self.decoder_device)).cpu(), latent, after=done)

        return Pipeline(encode_audio, diffuse, decode)

    def run(self, speech: torch.Tensor, steps: int, sink, seed: int = 0) -> StepTimes:
        """Generate `steps` latents for `speech` (16 kHz mono) and hand each step's frames to
        `sink(i, frames)`."""
        def encode_audio(i):
            w = self.family.audio_window(self.spec, speech, i)  # on the host: no wait
            return self.on_side_stream(lambda x: self.family.encode_audio(
                self.side, self.spec, x.to(self.decoder_device), i), w)

        return self.pipeline(encode_audio, seed).run(steps, sink)
