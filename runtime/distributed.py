"""The paper's layout across processes: rank 0 runs the audio encoder, the image and text
encoders and the decoder; ranks 1..tp run the transformer with tensor parallelism (one
all-reduce per block over their own group). torch.distributed, gloo on CPU (NCCL for the TP
group on GPUs), so CI runs the same code.

Per step i, rank 0 encodes audio i and broadcasts it, then receives latent i-1 from TP rank 0
and decodes it while the TP group denoises step i. The TP group sends latent i without
waiting (isend) and joins the next broadcast, so every hand-off holds one item: depth-one
queues with backpressure. Each rank records when it starts and ends its work per step
(time.monotonic is one clock for all processes of a machine).

On GPUs each TP rank runs on its target device, its all-reduce is NCCL (or, at the steady
shape, the fused GEMM + all-reduce over symmetric memory), and it loads its engine's
kernels and warms up with the others before rank 0 calls the group ready. Live sessions
stream steps to the ranks one at a time (RemotePipeline).

Faults: collectives time out (`timeout_s`), so a hung rank is detected, and a rank that dies
breaks its peers' collectives; either ends the session with a RankFailure on rank 0, and
the group is started afresh for the next session.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from charengine import audio as audio_mod
from charengine.warmup import warm_up, warm_up_side

from .engine import Engine
from .pipeline import Pipeline, StepTimes
from .worker import load_rank

CMD_STEPS, CMD_STOP, CMD_STREAM = 1, 2, 3


class RankFailure(RuntimeError):
    pass


def free_port() -> int:
    """A free TCP port on loopback for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fused_exchange(cfg, tp_group, device: torch.device):
    """The fused GEMM + all-reduce of a GPU TP group, bound once to the steady-state shape
    (collective over the group), or None where the plain GEMM-then-NCCL path applies."""
    from charengine.plugins import gemm_allreduce

    world = dist.get_world_size(tp_group)
    steady = (cfg.model.tokens_per_frame, cfg.model.dim)
    if not (cfg.switches.fused_gemm_allreduce
            and gemm_allreduce.use_fused(device, world, steady, steady, True)):
        return None
    x = gemm_allreduce.Exchange.symmetric(tp_group, *steady, device)
    return gemm_allreduce.SymmetricGemmAllReduce(x)


def _tp_rank_main(rank: int, world: int, port: int, engine_dir: str, timeout_s: float,
                  ready_timeout_s: float, log_dir: str):
    """A TP rank's process: global rank = rank + 1. Control and hand-offs to rank 0 go over
    gloo on CPU tensors; the TP group's all-reduce is NCCL on GPUs (or the fused kernel at
    the steady shape), gloo on CPU."""
    torch.set_num_threads(1)
    grank = rank + 1
    try:
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=grank,
                                world_size=world, timeout=timeout)
        # checksums run while the weights load; the rank is ready (barrier below) after both
        engine = Engine.load(engine_dir, ranks=[rank], verify_in_background=True)
        device = torch.device(engine.target.rank_devices()["tp"][rank])
        if device.type == "cuda":
            torch.cuda.set_device(device)
        tp_group = dist.new_group(list(range(1, world)), timeout=timeout,
                                  backend="nccl" if device.type == "cuda" else "gloo")

        def all_reduce(t):
            dist.all_reduce(t, group=tp_group)
            return t

        cfg = engine.config
        spec = cfg.model
        kernels = engine.kernel_cache().activate() if device.type == "cuda" else None
        fused = fused_exchange(cfg, tp_group, device) if device.type == "cuda" else None
        with engine.verifying():
            session = load_rank(engine, rank, device, all_reduce, fused)
        if device.type == "cuda":
            warm_up(session)  # in step with the other TP ranks: the same collectives
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=ready_timeout_s))
        lat = (spec.latent_channels, spec.latent_h, spec.latent_w)
        times = []
        with torch.inference_mode():
            while True:
                cmd = torch.zeros(3, dtype=torch.long)
                dist.broadcast(cmd, 0)
                if cmd[0] == CMD_STOP:
                    break
                steps, seed = int(cmd[1]), int(cmd[2])
                ref = torch.empty(lat)
                prompt = torch.empty(spec.prompt_tokens, spec.text_dim)
                dist.broadcast(ref, 0)
                dist.broadcast(prompt, 0)
                session.start(ref.to(device), prompt.to(device))
                g = torch.Generator().manual_seed(seed)  # the same noise on every rank
                pending = None
                times.clear()
                i = 0
                while cmd[0] == CMD_STEPS and i < steps or cmd[0] == CMD_STREAM:
                    if cmd[0] == CMD_STREAM:  # a live session: a go / end flag per step
                        go = torch.zeros(1, dtype=torch.long)
                        dist.broadcast(go, 0)
                        if go[0] == 0:
                            break
                    feats = torch.empty(spec.audio_tokens, spec.audio_dim)
                    dist.broadcast(feats, 0)
                    t0 = time.monotonic()
                    latent = session.step(torch.randn(lat, generator=g).to(device),
                                          feats.to(device)).cpu()
                    times.append((t0, time.monotonic()))
                    if rank == 0:
                        if pending is not None:
                            pending.wait()
                        pending = dist.isend(latent.contiguous(), 0)
                    i += 1
                if pending is not None:
                    pending.wait()
                if rank == 0 and cmd[0] == CMD_STEPS:
                    dist.send(torch.tensor(times, dtype=torch.float64).reshape(-1, 2), 0)
        if kernels is not None:
            kernels.close()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - written for rank 0 to report
        with open(os.path.join(log_dir, f"rank{grank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


class DistributedWorker:
    """Rank 0 of a TP engine: drives sessions on ranks 1..tp, decodes, hands frames to a sink.
    Same interface as Worker (start, run) so render() and charrun use either."""

    def __init__(self, engine: Engine, timeout_s: float = 60.0, log_dir: str | None = None,
                 ready_timeout_s: float = 600.0):
        """`timeout_s` bounds every hand-off in a session (a hung rank); `ready_timeout_s`
        bounds the ranks' start: weights, kernels, warm-up."""
        from charengine.sidenets import load_side

        engine.verified()
        self.engine, self.cfg, self.spec = engine, engine.config, engine.config.model
        self.timeout_s, self.ready_timeout_s = timeout_s, ready_timeout_s
        self.decoder_device = torch.device(engine.target.rank_devices()["decoder"])
        self.side = load_side(self.spec, engine.side_state(), self.decoder_device)
        if self.decoder_device.type == "cuda":
            warm_up_side(self.side, self.spec, self.decoder_device)
        self.log_dir = log_dir or os.path.join("/tmp", f"charengine-ranks-{os.getpid()}")
        os.makedirs(self.log_dir, exist_ok=True)
        self.ctx = None
        self.pending_start = None
        self._launch()

    # ---- the group ------------------------------------------------------------------
    def _launch(self) -> None:
        world = self.cfg.tp + 1
        for r in range(1, world):  # errors of an earlier group's ranks
            stale = os.path.join(self.log_dir, f"rank{r}.err")
            if os.path.exists(stale):
                os.remove(stale)
        port = free_port()
        self.ctx = mp.start_processes(
            _tp_rank_main, args=(world, port, str(self.engine.path), self.timeout_s,
                                 self.ready_timeout_s, self.log_dir),
            nprocs=self.cfg.tp, join=False, start_method="spawn")
        timeout = datetime.timedelta(seconds=self.timeout_s)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=world, timeout=timeout)
        # every rank joins every group's creation, with the TP ranks' backend
        dist.new_group(list(range(1, world)), timeout=timeout,
                       backend="nccl" if self.engine.target.device == "cuda" else "gloo")
        try:  # ready: every rank has loaded and warmed up
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=self.ready_timeout_s))
        except RuntimeError as e:
            raise self._failure(e, self.ready_timeout_s) from None

    def _failure(self, e: BaseException, waited_s: float | None = None) -> RankFailure:
        """Tear the group down after a fault; describe it in one line (with the last line of
        a rank's own error, when it wrote one). `waited_s`: the start-up's timeout, when the
        fault came while the ranks were getting ready."""
        procs = self.ctx.processes
        if waited_s is not None:  # at start-up: a rank that failed to load may be exiting
            settle = time.monotonic() + 3.0
            while time.monotonic() < settle and all(p.is_alive() for p in procs):
                time.sleep(0.05)
        dead = [i + 1 for i, p in enumerate(procs) if not p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the group is already broken
            pass
        self.ctx = None
        what = (f"rank {', '.join(map(str, dead))} died (exit "
                f"{', '.join(str(procs[r - 1].exitcode) for r in dead)})" if dead
                else f"a rank did not answer within {waited_s or self.timeout_s:g} s")
        for r in dead:
            err = os.path.join(self.log_dir, f"rank{r}.err")
            if os.path.isfile(err):
                lines = [ln for ln in open(err).read().splitlines() if ln.strip()]
                if lines:
                    what += f": {lines[-1].strip()}"
                    break
        return RankFailure(f"session failed: {what} ({type(e).__name__})")

    def close(self) -> None:
        if self.ctx is None:
            return
        try:
            dist.broadcast(torch.tensor([CMD_STOP, 0, 0]), 0)
            # join() returns as soon as one process has exited: wait for all of them before
            # the store they still talk to goes away with the group
            deadline = time.monotonic() + self.timeout_s
            while not self.ctx.join(max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    break
        finally:
            for p in self.ctx.processes:
                if p.is_alive():
                    p.kill()
            dist.destroy_process_group()
            self.ctx = None

    # ---- sessions -------------------------------------------------------------------
    @torch.inference_mode()
    def start(self, image: torch.Tensor, prompt: str) -> None:
        if self.ctx is None:  # the last session ended in a fault: a fresh group
            self._launch()
        self.side.decoder.reset()
        self.pending_start = (
            self.side.image_encoder(image.to(self.decoder_device)).cpu().contiguous(),
            self.side.text_encoder(prompt).cpu().contiguous())

    def pipeline(self, encode_audio, seed: int = 0) -> Pipeline:
        """A live session's pipeline (runtime/live.py) over the rank group: steps are sent
        one at a time as rank 0 encodes their audio, for as long as the pipeline runs."""
        return RemotePipeline(self, encode_audio, seed)

    @torch.inference_mode()
    def run(self, speech: torch.Tensor, steps: int, sink, seed: int = 0) -> StepTimes:
        spec, times = self.spec, StepTimes()
        lat = (spec.latent_channels, spec.latent_h, spec.latent_w)
        ref, prompt = self.pending_start
        try:
            dist.broadcast(torch.tensor([CMD_STEPS, steps, seed]), 0)
            dist.broadcast(ref, 0)
            dist.broadcast(prompt, 0)
            for i in range(steps + 1):
                if i < steps:
                    t0 = time.monotonic()
                    window = audio_mod.step_window(spec, speech, i).to(self.decoder_device)
                    feats = self.side.audio_encoder(window).cpu().contiguous()
                    times.audio.append((t0, time.monotonic()))
                    dist.broadcast(feats, 0)
                if i >= 1:
                    latent = torch.empty(lat)
                    dist.recv(latent, 1)
                    t0 = time.monotonic()
                    frames = self.side.decoder(latent.to(self.decoder_device)).cpu()
                    times.decode.append((t0, time.monotonic()))
                    t0 = time.monotonic()
                    sink(i - 1, frames)
                    times.sink.append((t0, time.monotonic()))
            diffusion = torch.empty(steps, 2, dtype=torch.float64)
            dist.recv(diffusion, 1)
            times.diffusion = [tuple(r) for r in diffusion.tolist()]
        except RuntimeError as e:  # gloo errors and timeouts (DistBackendError included)
            raise self._failure(e) from None
        except BaseException as e:  # the sink failed or Ctrl-C: the group is mid-session
            self._failure(e)
            raise
        return times


class RemotePipeline(Pipeline):
    """The three-stage pipeline with its diffusion stage on the TP ranks. The first step
    opens a streamed session on them (reference and prompt from the worker's start); each
    step sends a go flag and the audio features and receives the latent back; when the
    pipeline stops, an end flag returns the ranks to their command loop."""

    def __init__(self, worker: DistributedWorker, encode_audio, seed: int):
        spec = worker.spec
        self.worker, self.seed, self.opened = worker, seed, False
        self.lat = (spec.latent_channels, spec.latent_h, spec.latent_w)
        super().__init__(encode_audio, self._diffuse, self._decode)

    def _diffuse(self, i: int, feats: torch.Tensor) -> torch.Tensor:
        if not self.opened:
            ref, prompt = self.worker.pending_start
            dist.broadcast(torch.tensor([CMD_STREAM, 0, self.seed]), 0)
            dist.broadcast(ref, 0)
            dist.broadcast(prompt, 0)
            self.opened = True
        dist.broadcast(torch.ones(1, dtype=torch.long), 0)
        dist.broadcast(feats.cpu().contiguous(), 0)
        latent = torch.empty(self.lat)
        dist.recv(latent, 1)
        return latent

    def _decode(self, latent: torch.Tensor) -> torch.Tensor:
        return self.worker.side.decoder(latent.to(self.worker.decoder_device)).cpu()

    def run(self, steps, sink) -> StepTimes:
        w = self.worker
        if w.ctx is None:
            w._launch()
        try:
            times = super().run(steps, sink)
            if self.opened:  # every sent step was received: the ranks wait for a flag
                dist.broadcast(torch.zeros(1, dtype=torch.long), 0)
            return times
        except RuntimeError as e:  # gloo errors and timeouts (DistBackendError included)
            raise w._failure(e) from None
        except BaseException as e:
            w._failure(e)
            raise


def open_worker(engine: Engine):
    """The worker for an engine's layout: TP-1 in this process, else rank 0 of a group."""
    if engine.config.tp == 1:
        from .worker import Worker

        return Worker(engine)
    return DistributedWorker(engine)
