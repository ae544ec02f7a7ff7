"""The paper's layout across processes: rank 0 runs the audio encoder, the image and text
encoders and the decoder; ranks 1..tp run the transformer with tensor parallelism (one
all-reduce per block over their own group). torch.distributed, gloo on CPU (NCCL for the TP
group on GPUs), so CI runs the same code.

Per step i, rank 0 encodes audio i and broadcasts it, then receives latent i-1 from TP rank 0
and decodes it while the TP group denoises step i. The TP group sends latent i without
waiting (isend) and joins the next broadcast, so every hand-off holds one item: depth-one
queues with backpressure. Each rank records when it starts and ends its work per step
(time.monotonic is one clock for all processes of a machine) and the step's busy time (a
DeviceSpan: GPU time on a GPU), which goes to rank 0 with a live step's latent, or with a
render's times at its end.

On GPUs each TP rank runs on its target device, its all-reduce is NCCL (or, at the steady
shape, the fused GEMM + all-reduce over symmetric memory), and it loads its engine's
kernels and warms up with the others before rank 0 calls the group ready. Live sessions
stream steps to the ranks one at a time (RemotePipeline).

Faults: every hand-off in a session times out (`timeout_s`), so a hung rank is detected,
and a rank that dies breaks its peers' collectives; either ends the session with a
RankFailure on rank 0, and the group is started afresh for the next session (also where a
rank died while idle). Between sessions the ranks wait for the next command on a group
without a timeout, for as long as rank 0 lives; they leave with it. At start-up each rank
reports its stages through the store while rank 0 watches the processes, so a rank that
dies while starting ends the start at once, in one line naming it.
"""

from __future__ import annotations

import datetime
import os
import shutil
import socket
import tempfile
import threading
import time
import traceback

import multiprocessing as mp

import torch
import torch.distributed as dist

from charengine.family import family_of
from charengine.mapping import Mapping
from charengine.timing import DeviceSpan

from .engine import Engine, EngineError
from .lanes import CAPACITY_STEPS, Capacity, Lane, Turns
from .pipeline import Pipeline, StepTimes, Timed
from .run_config import AUTO
from .worker import load_rank

# the rank processes' commands, broadcast on the control group as HEADER longs (op, lane,
# steps, seed): a render of `steps` on a lane (CMD_STEPS), the group's end (CMD_STOP), a live
# session opened on a lane (CMD_START) and one of its steps (CMD_STEP), the lanes served
# (CMD_LANES: `steps` of them)
CMD_STEPS, CMD_STOP, CMD_START, CMD_STEP, CMD_LANES = 1, 2, 3, 4, 5
HEADER = 4


class RankFailure(RuntimeError):
    pass


def free_port() -> int:
    """A free TCP port on loopback for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fused_exchange(cfg, mapping: Mapping, peer_devices: list[str]):
    """The fused GEMM + all-reduce of a GPU TP group, bound once to the steady-state shape
    (collective over mapping.group), or None where the plain GEMM-then-NCCL path applies:
    switched off, one rank, a CPU, or GPUs without symmetric memory between them."""
    from charengine.plugins import gemm_allreduce

    device = mapping.torch_device
    fused = family_of(cfg).fused_allreduce(cfg)
    if fused is None:
        return None
    steady = (fused.m, fused.n)
    symmetric = gemm_allreduce.symmetric_memory_available(device, peer_devices)
    if not gemm_allreduce.use_fused(device, mapping.tp, steady, steady, symmetric):
        return None
    x = gemm_allreduce.Exchange.symmetric(mapping.group, *steady, device)
    return gemm_allreduce.SymmetricGemmAllReduce(x)


# Idle ranks wait for the next command on a group of their own for as long as the server
# lives; every hand-off inside a session keeps the session timeout, so a hung rank is caught.
IDLE_TIMEOUT = datetime.timedelta(days=3650)
# How often rank 0 looks at the store and the processes while the ranks start (each rank
# reports the stages joined, loaded and ready), so a rank that dies ends the start at once.
POLL_S = 0.05
# A rank's last error line that says its collective broke because of a peer.
COLLATERAL_ERRORS = ("Timed out", "Connection closed by peer", "Connection reset by peer",
                     "Read error", "Write error")
FAULT_SETTLE_S = 3.0  # a start-up collective broke: time for the rank that broke it to exit
PARENT_POLL_S = 0.2


def _stage_key(stage: str, rank: int) -> str:
    return f"charengine/{stage}/{rank}"


def _detach_from_rank0() -> None:
    """A TP rank's own process group and session: Ctrl-C at a terminal reaches rank 0 alone,
    which stops the ranks between steps; the rank exits by itself within PARENT_POLL_S once
    rank 0 is gone, whatever thread started it (a parent-death signal would fire when that
    thread ends, which for a relaunch is an executor's)."""
    import threading

    try:
        os.setsid()
    except OSError:
        pass
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="rank0-watch", daemon=True).start()


def _tp_rank_main(rank: int, world: int, port: int, engine_dir: str, timeout_s: float,
                  ready_timeout_s: float, log_dir: str):
    """A TP rank's process (global rank: its Mapping's). Control and hand-offs to rank 0 go over
    gloo on CPU tensors; the TP group's all-reduce is NCCL on GPUs (or the fused kernel at
    the steady shape), gloo on CPU. Any error is written for rank 0 to report, and the
    process exits 1 without printing it."""
    _detach_from_rank0()
    torch.set_num_threads(1)
    grank = Mapping(world - 1, rank, host_process=True).global_rank
    try:
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world_size=world, is_master=False,
                              timeout=timeout)
        store.set(_stage_key("joined", rank), "1")
        dist.init_process_group("gloo", store=store, rank=grank, world_size=world,
                                timeout=timeout)
        # checksums run while the weights load; the rank is ready (barrier below) after both
        engine = Engine.load(engine_dir, ranks=[rank], verify_in_background=True)
        mapping = engine.target.mapping(rank)
        device = mapping.torch_device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store.set(_stage_key("loaded", rank), "1")
        control = dist.new_group(list(range(world)), timeout=IDLE_TIMEOUT, backend="gloo")
        tp_group = dist.new_group(mapping.tp_global_ranks, timeout=timeout,
                                  backend="nccl" if device.type == "cuda" else "gloo")
        mapping = mapping.with_group(tp_group)
        cfg = engine.config
        shapes = family_of(cfg).step_shapes(cfg.model)
        kernels = engine.kernel_cache().activate() if device.type == "cuda" else None
        fused = fused_exchange(cfg, mapping, engine.target.rank_devices()["tp"]) \
            if device.type == "cuda" else None
        with engine.verifying():
            session = load_rank(engine, mapping, fused)
        if device.type == "cuda":
            family_of(cfg).warm_up(session)  # in step with the other TP ranks: the same collectives
        store.set(_stage_key("ready", rank), "1")
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=ready_timeout_s))
        sessions = [session]  # a lane's session each (CMD_LANES adds the others)
        noise_of: list = [None]
        with torch.inference_mode():
            while True:
                cmd = torch.zeros(HEADER, dtype=torch.long)
                dist.broadcast(cmd, 0, group=control)  # idle: no timeout
                op, lane, steps, seed = (int(x) for x in cmd)
                if op == CMD_STOP:
                    break
                if op == CMD_LANES:  # every lane's session over the one model, warmed up
                    while len(sessions) < steps:
                        sessions.append(session.sibling())
                        noise_of.append(None)
                        if device.type == "cuda":  # in step with the other TP ranks
                            family_of(cfg).warm_up(sessions[-1])
                    continue
                if op in (CMD_START, CMD_STEPS):  # a session opens on the lane
                    ref = torch.empty(shapes.reference)
                    prompt = torch.empty(shapes.prompt)
                    dist.broadcast(ref, 0)
                    dist.broadcast(prompt, 0)
                    sessions[lane].start(ref.to(device), prompt.to(device))
                    noise_of[lane] = torch.Generator().manual_seed(seed)  # the same on every rank
                if op == CMD_START:
                    continue
                # CMD_STEP: one step of a live session; CMD_STEPS: a render's `steps`, each
                # latent sent without waiting while the next step's features arrive
                pending, times = [], []
                for _ in range(1 if op == CMD_STEP else steps):
                    feats = torch.empty(shapes.features)
                    dist.broadcast(feats, 0)
                    t0 = time.monotonic()
                    noise = torch.randn(shapes.noise_shape, generator=noise_of[lane]).to(device)
                    span = DeviceSpan(device)
                    latent = sessions[lane].step(noise, feats.to(device))
                    span.end()
                    latent = latent.cpu()  # waits for the step: its span is read at once
                    busy = torch.tensor([span.seconds(wait=True)], dtype=torch.float64)
                    times.append((t0, time.monotonic(), float(busy)))
                    if rank == 0:
                        for work in pending:
                            work.wait()
                        pending = [dist.isend(latent.contiguous(), 0)]
                        if op == CMD_STEP:  # a live step's busy time rides with it
                            pending.append(dist.isend(busy, 0))
                for work in pending:
                    work.wait()
                if rank == 0 and op == CMD_STEPS:
                    dist.send(torch.tensor(times, dtype=torch.float64).reshape(-1, 3), 0)
        if kernels is not None:
            kernels.close()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - written for rank 0 to report, in one line
        try:
            with open(os.path.join(log_dir, f"rank{grank}.err"), "w") as f:
                f.write(traceback.format_exc())
        finally:
            os._exit(1)
    os._exit(0)  # stopped: leave at once, without the interpreter's teardown


class _Ranks:
    """The TP ranks' processes (spawned, not forked: CUDA and gloo start clean in each)."""

    def __init__(self, processes, global_ranks: list[int]):
        self.processes, self.global_ranks = processes, global_ranks

    def dead(self) -> list[int]:
        """Global ranks whose process has exited."""
        return [g for g, p in zip(self.global_ranks, self.processes) if p.exitcode is not None]

    def stop(self, grace_s: float) -> None:
        """Wait up to grace_s for every rank to exit, then kill the rest."""
        deadline = time.monotonic() + grace_s
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.processes:
            if p.is_alive():
                p.kill()
        for p in self.processes:
            p.join(5)


class DistributedWorker:
    """Rank 0 of a TP engine: drives sessions on ranks 1..tp, decodes, hands frames to a sink.
    Same interface as Worker (start, run) so render() and charrun use either."""

    def __init__(self, engine: Engine, timeout_s: float = 60.0, log_dir: str | None = None,
                 ready_timeout_s: float = 600.0, stop_grace_s: float = 1.5,
                 sessions: int | str = 1, over_capacity: bool = False):
        """`timeout_s` bounds every hand-off in a session (a hung rank); `ready_timeout_s`
        bounds the ranks' start: weights, kernels, warm-up; `stop_grace_s` is how long
        close() lets the ranks exit before it kills them. `sessions`: the lanes served at
        once (every rank holds a session per lane over its one model), measured against
        what the group holds in real time as Worker does (`over_capacity` serves more)."""
        t0 = time.perf_counter()
        engine.verified()
        self.engine, self.cfg, self.spec = engine, engine.config, engine.config.model
        self.target = engine.target  # what the page and /status name
        self.timeout_s, self.ready_timeout_s = timeout_s, ready_timeout_s
        self.stop_grace_s = stop_grace_s
        # a steady step's processing time is not measured across the group: a live session's
        # first deadlines use its first step's (runtime/live.py)
        self.processing_s = None
        self.mapping = engine.target.mapping(0)
        self.family = family_of(self.cfg)
        self.decoder_device = torch.device(self.mapping.decoder_device)
        # this process's device (its side networks'): the DiT runs on the ranks' own
        self.device = self.decoder_device
        self.side = self.family.load_side(self.cfg, engine.side_state(), self.decoder_device)
        if self.decoder_device.type == "cuda":
            self.family.warm_up_side(self.side, self.spec, self.decoder_device)
        self.own_log_dir = log_dir is None
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="charengine-ranks-")
        os.makedirs(self.log_dir, exist_ok=True)
        self.ctx: _Ranks | None = None
        self.store = None
        self.control = None
        self.last_failure: str | None = None
        self.group_lock = threading.RLock()  # a launch or a teardown at a time
        self.side_lock = threading.RLock()  # one session's call on the side networks at a time
        self.turns = Turns()  # one exchange with the ranks at a time, earliest deadline first
        self.lanes = [RemoteLane(self, 0, self.side.decoder)]
        self.capacity: Capacity | None = None
        try:
            self._launch()
            if sessions != 1:
                self.capacity = self.measure_capacity()
                n = self.capacity.sessions if sessions == AUTO else sessions
                if n > self.capacity.sessions and not over_capacity:
                    raise EngineError(f"--sessions {n}: {self.capacity.describe()}; give "
                                      f"--sessions {max(1, self.capacity.sessions)} or fewer, "
                                      f"or --sessions {AUTO}")
                self.lanes += [RemoteLane(self, i, self.family.session_decoder(self.side))
                               for i in range(1, max(1, n))]
                self._serve_lanes()
        except BaseException:
            self.close()
            raise
        # the ranks load, warm up and capture their graphs in their own processes: the whole
        # start is the load here
        self.startup = {"load_s": time.perf_counter() - t0, "warm_up_s": 0.0,
                        "warm_up_steps": 0, "sessions": len(self.lanes),
                        "capacity": self.capacity.to_dict() if self.capacity else None}

    # ---- the group ------------------------------------------------------------------
    def _launch(self) -> None:
        world = self.mapping.world_size
        for r in self.mapping.tp_global_ranks:  # errors of an earlier group's ranks
            stale = os.path.join(self.log_dir, f"rank{r}.err")
            if os.path.exists(stale):
                os.remove(stale)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        self.store = dist.TCPStore("127.0.0.1", 0, world_size=world, is_master=True,
                                   timeout=timeout, wait_for_workers=False)
        spawn = mp.get_context("spawn")
        self.ctx = _Ranks([spawn.Process(
            target=_tp_rank_main, name=f"charengine-rank{self.engine.target.mapping(r).global_rank}",
            args=(r, world, self.store.port, str(self.engine.path), self.timeout_s,
                  self.ready_timeout_s, self.log_dir)) for r in range(self.cfg.tp)],
            self.mapping.tp_global_ranks)
        for p in self.ctx.processes:
            p.start()
        deadline = time.monotonic() + self.ready_timeout_s
        try:
            self._await_stage("joined", deadline)
            dist.init_process_group("gloo", store=self.store, rank=0, world_size=world,
                                    timeout=timeout)
            self._await_stage("loaded", deadline)
            # every rank joins every group's creation, with the TP ranks' backend
            self.control = dist.new_group(list(range(world)), timeout=IDLE_TIMEOUT,
                                          backend="gloo")
            dist.new_group(self.mapping.tp_global_ranks, timeout=timeout,
                           backend="nccl" if self.engine.target.device == "cuda" else "gloo")
            self._await_stage("ready", deadline)  # every rank has loaded and warmed up
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=self.ready_timeout_s))
        except (RuntimeError, TimeoutError) as e:
            raise self._failure(e, self.ready_timeout_s) from None
        except BaseException as e:  # Ctrl-C while the ranks start
            self._failure(e)
            raise

    def _await_stage(self, stage: str, deadline: float) -> None:
        keys = [_stage_key(stage, r) for r in range(self.cfg.tp)]
        while not self.store.check(keys):
            if self.ctx.dead():
                raise RuntimeError(f"a rank exited before it was {stage}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the ranks were not {stage} in time")
            time.sleep(POLL_S)

    def _failure(self, e: BaseException, waited_s: float | None = None) -> RankFailure:
        """Tear the group down after a fault; describe it in one line (with the last line of
        a rank's own error, when it wrote one). `waited_s`: the start-up's timeout, when the
        fault came while the ranks were getting ready. Every lane's session ends with the
        group: the first to see the fault names it, the others say so."""
        with self.group_lock:
            if self.ctx is None:
                return RankFailure(f"session failed: {self.last_failure or 'the ranks stopped'}")
            failure = self._teardown(e, waited_s)
            self.last_failure = str(failure).removeprefix("session failed: ")
            return failure

    def _teardown(self, e: BaseException, waited_s: float | None) -> RankFailure:
        procs = self.ctx.processes
        if waited_s is not None and isinstance(e, (RuntimeError, TimeoutError)):
            settle = time.monotonic() + FAULT_SETTLE_S  # a rank that failed may be exiting
            while time.monotonic() < settle and not self.ctx.dead():
                time.sleep(POLL_S)
        dead = self.ctx.dead()
        self.ctx.stop(0.0)
        self._drop_group()
        errors = {}
        for r in dead:
            err = os.path.join(self.log_dir, f"rank{r}.err")
            if os.path.isfile(err):
                lines = [ln.strip() for ln in open(err).read().splitlines() if ln.strip()]
                if lines:
                    errors[r] = lines[-1]
        waited = f"{waited_s or self.timeout_s:g} s"
        # ranks that left only because a peer broke their collective: not the cause
        collateral = [r for r, line in errors.items()
                      if any(m in line for m in COLLATERAL_ERRORS)]
        cause = [r for r in dead if r not in collateral] or dead
        timed_out = [r for r in dead if "Timed out" in errors.get(r, "")]
        if dead and len(timed_out) == len(dead):  # they gave up on a peer that hangs
            what = (f"a rank did not answer within {waited} (rank "
                    f"{', '.join(map(str, timed_out))} timed out waiting for it)")
        elif dead:
            what = (f"rank {', '.join(map(str, cause))} died (exit "
                    f"{', '.join(str(procs[r - 1].exitcode) for r in cause)})")
            first = next((errors[r] for r in cause if r in errors and r not in collateral),
                         None)
            if first:
                what += f": {first}"
        else:
            what = f"a rank did not answer within {waited}"
        when = "start-up failed" if waited_s is not None else "session failed"
        return RankFailure(f"{when}: {what} ({type(e).__name__})")

    def _drop_group(self) -> None:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the group is already broken
            pass
        self.ctx = self.store = self.control = None

    def _remove_log_dir(self) -> None:
        if self.own_log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def alive(self) -> bool:
        """Every rank process is running (a rank that died while idle is found here)."""
        return self.ctx is not None and not self.ctx.dead()

    def deaths(self) -> str:
        """Which rank processes have exited, and how, for the log ("rank 2 died (exit -9)")."""
        if self.ctx is None:
            return "the ranks are stopped"
        dead = self.ctx.dead()
        codes = ", ".join(str(self.ctx.processes[self.ctx.global_ranks.index(r)].exitcode)
                          for r in dead)
        return f"rank {', '.join(map(str, dead))} died (exit {codes})"

    def ensure_ranks(self) -> None:
        """Before a session: a fresh group where the last one ended in a fault or a rank
        died while idle, serving every lane."""
        with self.group_lock:
            if self.ctx is not None and self.ctx.dead():
                self._failure(RuntimeError("a rank died while idle"))
            if self.ctx is None:
                self._launch()
                self._serve_lanes()

    def close(self) -> None:
        """Stop the ranks (within stop_grace_s, then they are killed) and remove their
        logs."""
        if self.ctx is None:
            self._remove_log_dir()
            return
        try:
            if not self.ctx.dead():
                work = dist.broadcast(torch.tensor([CMD_STOP, 0, 0, 0]), 0,
                                      group=self.control, async_op=True)
                work.wait()
            self.ctx.stop(self.stop_grace_s)
        except RuntimeError:
            self.ctx.stop(0.0)
        finally:
            self._drop_group()
            self._remove_log_dir()

    # ---- sessions -------------------------------------------------------------------
    def on_side_stream(self, fn, *inputs, after=None, timed: bool = False):
        """As Worker's: here the side networks have the host process's device to
        themselves, so fn runs on its current stream, one session's call at a time
        (`timed`: as Timed, with the busy time of fn's work)."""
        with self.side_lock:
            span = DeviceSpan(self.decoder_device)
            out = fn(*inputs)
            return Timed(out, span.end()) if timed else out

    def _send(self, op: int, lane: int = 0, steps: int = 0, seed: int = 0) -> None:
        """A command to every rank (the caller holds a turn: one exchange at a time)."""
        dist.broadcast(torch.tensor([op, lane, steps, seed]), 0, group=self.control)

    def _open(self, lane: int, op: int, steps: int, seed: int) -> None:
        ref, prompt = self.lanes[lane].pending_start
        self._send(op, lane, steps, seed)
        dist.broadcast(ref, 0)
        dist.broadcast(prompt, 0)

    def _step(self, lane: int, feats: torch.Tensor) -> Timed:
        """One step of the live session on `lane`: its features out, its latent and the
        ranks' busy time back."""
        self._send(CMD_STEP, lane)
        dist.broadcast(feats.cpu().float().contiguous(), 0)  # fp32, as ranks receive it
        latent = torch.empty(self.family.step_shapes(self.spec).latent)
        dist.recv(latent, 1)
        busy = torch.empty(1, dtype=torch.float64)  # the step's busy time on the TP ranks
        dist.recv(busy, 1)
        return Timed(latent, float(busy))

    def _serve_lanes(self) -> None:
        """The ranks' sessions for every lane (after each launch of the group)."""
        if len(self.lanes) > 1:
            with self.turns.turn():
                self._send(CMD_LANES, 0, len(self.lanes))

    @torch.inference_mode()
    def measure_capacity(self, steps: int = CAPACITY_STEPS, seed: int = 0) -> Capacity:
        """As Worker.measure_capacity, over the group (Lane.measure_capacity on the first
        lane): a step's diffusion timed by the TP ranks (their own measure, sent with the
        latent), its audio encode and decode on this process's device."""
        lane = self.lanes[0]
        lane.start(torch.zeros(3, self.spec.out_h, self.spec.out_w), "")
        # on one device (a CPU's cores, a GPU shared with the decoder) the parts add up
        shared = self.mapping.torch_device == self.decoder_device
        with self.turns.turn():
            try:
                self._open(0, CMD_START, 0, seed)
                return lane.measure_capacity(lambda feats: self._step(0, feats), steps, shared)
            except RuntimeError as e:
                raise self._failure(e) from None

    def start(self, image: torch.Tensor, prompt: str) -> None:
        """New session on the first lane (what a worker of one session runs)."""
        self.lanes[0].start(image, prompt)

    def pipeline(self, encode_audio, seed: int = 0) -> Pipeline:
        return self.lanes[0].pipeline(encode_audio, seed)

    def run(self, speech: torch.Tensor, steps: int, sink, seed: int = 0) -> StepTimes:
        return self.lanes[0].run(speech, steps, sink, seed)


class RemoteLane(Lane):
    """One session's place on the rank group: its session on every TP rank (the ranks'
    `sessions[index]`), its decoder state here; its exchanges with the ranks take the
    worker's turns, one at a time, the earliest deadline first."""

    def __init__(self, worker: DistributedWorker, index: int, decoder):
        super().__init__(worker, index, None, decoder)  # its session is on the ranks
        self.pending_start = None

    @torch.inference_mode()
    def start(self, image: torch.Tensor, prompt: str) -> None:
        self.worker.ensure_ranks()
        with self.worker.side_lock:
            self.pending_start = (
                self.side.image_encoder(image.to(self.decoder_device)).cpu().contiguous(),
                self.side.text_encoder(prompt).cpu().contiguous())
        self.decoder.reset()

    def pipeline(self, encode_audio, seed: int = 0) -> Pipeline:
        """A live session's pipeline (runtime/live.py) over the rank group: steps are sent
        one at a time as this process encodes their audio, for as long as it runs."""
        return RemotePipeline(self, encode_audio, seed)

    @torch.inference_mode()
    def run(self, speech: torch.Tensor, steps: int, sink, seed: int = 0) -> StepTimes:
        """A render on this lane: every step sent as its audio is encoded, the latent of the
        step before decoded while the ranks denoise the next; the lane holds the device for
        the render."""
        w, spec, times = self.worker, self.spec, StepTimes()
        w.ensure_ranks()
        lat = self.family.step_shapes(spec).latent
        try:
            with w.turns.turn():
                w._open(self.index, CMD_STEPS, steps, seed)
                for i in range(steps + 1):
                    if i < steps:
                        t0 = time.monotonic()
                        feats = self.encode_window(
                            self.family.audio_window(spec, speech, i), i, timed=True)
                        times.audio.append((t0, time.monotonic()))
                        times.add_busy("audio", feats.span)
                        dist.broadcast(feats.value.cpu().float().contiguous(), 0)
                    if i >= 1:
                        latent = torch.empty(lat)
                        dist.recv(latent, 1)
                        t0 = time.monotonic()
                        frames = self.decode(latent, timed=True)
                        times.decode.append((t0, time.monotonic()))
                        times.add_busy("decode", frames.span)
                        t0 = time.monotonic()
                        sink(i - 1, frames.value)
                        times.sink.append((t0, time.monotonic()))
                diffusion = torch.empty(steps, 3, dtype=torch.float64)
                dist.recv(diffusion, 1)
            for t0, t1, busy in diffusion.tolist():
                times.diffusion.append((t0, t1))
                times.add_busy("diffusion", busy)
        except RuntimeError as e:  # gloo errors and timeouts (DistBackendError included)
            raise w._failure(e) from None
        except BaseException as e:  # the sink failed or Ctrl-C: the group is mid-session
            w._failure(e)
            raise
        return times


class RemotePipeline(Pipeline):
    """The three-stage pipeline with its diffusion stage on the TP ranks. The first step
    opens the lane's session on them (reference and prompt from the lane's start); each step
    sends the audio features and receives the latent back, in a turn of its own."""

    def __init__(self, lane: RemoteLane, encode_audio, seed: int):
        self.lane, self.worker, self.seed, self.opened = lane, lane.worker, seed, False
        super().__init__(encode_audio, self._diffuse, self._decode)

    def _diffuse(self, i: int, feats: torch.Tensor) -> Timed:
        w = self.worker
        with w.turns.turn():
            if not self.opened:
                w._open(self.lane.index, CMD_START, 0, self.seed)
                self.opened = True
            return w._step(self.lane.index, feats)

    def _decode(self, item: Timed) -> Timed:
        """The step's frames; where the decoder streams, from its pieces' calls (the shapes
        the side networks' warm-up ran), as Worker.pipeline's render decodes them."""
        lane, latent = self.lane, item.value
        pieces = lane.pieces(latent) or (latent,)
        return lane.on_side_stream(lambda *ps: torch.cat(
            [lane.decoder(p.to(lane.decoder_device)).cpu() for p in ps]), *pieces, timed=True)

    def run(self, steps, sink) -> StepTimes:
        w = self.worker
        w.ensure_ranks()
        try:
            return super().run(steps, sink)
        except RuntimeError as e:  # gloo errors and timeouts (DistBackendError included)
            raise w._failure(e) from None
        except BaseException as e:
            w._failure(e)
            raise


def open_worker(engine: Engine, sessions: int | str = 1, over_capacity: bool = False,
                batch: int = 1):
    """The worker for an engine's layout: TP-1 in this process, else (or where the target
    puts its ranks in processes of their own) rank 0 of a group. `sessions`: the sessions it
    serves at once over one copy of the engine (runtime/lanes.py; on a group, every rank
    holds a session per lane); `batch`: the most of their steps run as one batch (a TP-1
    worker's; a group steps its sessions one at a time)."""
    if not engine.target.mapping(0).host_process:
        from .worker import Worker

        return Worker(engine, sessions=sessions, over_capacity=over_capacity, batch=batch)
    if batch > 1:
        raise EngineError(f"--batch {batch}: engine {engine.target.name} runs its ranks in "
                          "processes of their own, which step sessions one at a time; give "
                          "--batch 1")
    return DistributedWorker(engine, sessions=sessions, over_capacity=over_capacity)
