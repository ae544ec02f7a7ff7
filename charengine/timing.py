"""Timing for charrun's figures and the benchmarks: the time of a block, a call or a span
of queued work, on the GPU by a pair of CUDA events, on the CPU (or as wall time) by
perf_counter.

    median(xs) -> float                 the median of the values (statistics.median)
    Span(device=None, wall=False)       a `with` block's milliseconds, read as `.ms` after it
    DeviceSpan(device=None)             the work queued until .end(), its busy time read
                                        later without waiting (.seconds()): what charrun's
                                        figures use
    Mark(fn, device=None)               fn() run and its start and end recorded without waiting
                                        for the device (a step loop stays asynchronous); read
                                        `.ms` and `.since(earlier)` once the device is synced
    cuda_ms(fn, reps, warmup=0, device=None) -> list[float]
                                        fn() timed `reps` times after `warmup` untimed calls,
                                        by CUDA events (GPU time) where the device is CUDA
    wall_ms(fn, reps, warmup=0, device=None) -> list[float]
                                        the same as synchronized wall time (host launches
                                        included)

`device` is a torch.device, a name ("cuda", "cpu") or None: the current CUDA device where
CUDA is available, else the CPU. The lists hold one value per timed call, in order; a caller
takes their median (or scales each first, e.g. to microseconds per call of a graph), or
drops the first few itself.
"""

from __future__ import annotations

import statistics
import time

import torch


def median(xs) -> float:
    return statistics.median(xs)


def percentile(xs, q: float) -> float:
    """The q-th percentile of xs, nearest rank (one of the values)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def _device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Span:
    """Milliseconds of the code in a `with` block: `with Span(dev) as s: work()`, then `s.ms`.
    On a CUDA device (wall=False) a CUDA event is recorded on the current stream before and
    after the block and the exit waits for the second one: the GPU time between them.
    Otherwise perf_counter around the block, the device synchronized on entry and exit."""

    def __init__(self, device=None, wall: bool = False):
        self.device = _device(device)
        self.events = self.device.type == "cuda" and not wall
        self.ms: float | None = None

    def __enter__(self) -> "Span":
        if self.events:
            self._a = torch.cuda.Event(enable_timing=True)
            self._b = torch.cuda.Event(enable_timing=True)
            self._a.record()
        else:
            _sync(self.device)
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.events:
            self._b.record()
            self._b.synchronize()
            self.ms = self._a.elapsed_time(self._b)
        else:
            _sync(self.device)
            self.ms = 1e3 * (time.perf_counter() - self._t0)


class Mark:
    """fn() run, its start and end recorded without waiting: CUDA events on a CUDA device
    (read them after the device is synchronized), perf_counter times elsewhere."""

    def __init__(self, fn, device=None):
        self.events = _device(device).type == "cuda"
        if self.events:
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)
            self.start.record()
            fn()
            self.end.record()
        else:
            self.start = time.perf_counter()
            fn()
            self.end = time.perf_counter()

    @property
    def ms(self) -> float:
        """fn()'s milliseconds."""
        return self.start.elapsed_time(self.end) if self.events \
            else 1e3 * (self.end - self.start)

    def since(self, earlier: "Mark") -> float:
        """Milliseconds from `earlier`'s end to this one's (a step period)."""
        return earlier.end.elapsed_time(self.end) if self.events \
            else 1e3 * (self.end - earlier.end)


class DeviceSpan:
    """The work queued on a device between creation and end(), timed without waiting for it:
    on a CUDA device a pair of timing events recorded on the current stream (the GPU's time
    from the first to the last of that work, not the host's time to launch it), elsewhere
    perf_counter (the host's time, which on a CPU is the work's). `seconds()` reads it once the
    work is done (None before; wait=True waits for it); `done` is the end event to make
    another stream wait on (None off CUDA). What charrun's figures are made of: a step's
    diffusion, decode and audio encoding each report the busy time of their own work."""

    def __init__(self, device=None):
        self.cuda = _device(device).type == "cuda"
        self.done = None
        self._seconds: float | None = None
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()

    def end(self) -> "DeviceSpan":
        if self.cuda:
            self.done = torch.cuda.Event(enable_timing=True)
            self.done.record()
        else:
            self._seconds = time.perf_counter() - self.t0
        return self

    def seconds(self, wait: bool = False) -> float | None:
        """The span's seconds; None while its work is still running (unless `wait`)."""
        if self._seconds is None and self.done is not None:
            if wait:
                self.done.synchronize()
            elif not self.done.query():
                return None
            self._seconds = self.start.elapsed_time(self.done) / 1e3
        return self._seconds


def _time_ms(fn, reps: int, warmup: int, device, wall: bool) -> list[float]:
    device = _device(device)
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        with Span(device, wall) as s:
            fn()
        times.append(s.ms)
    return times


def cuda_ms(fn, reps: int, warmup: int = 0, device=None) -> list[float]:
    """Milliseconds of each of `reps` calls of fn() after `warmup` untimed ones: GPU time
    between CUDA events on a CUDA device, perf_counter time elsewhere."""
    return _time_ms(fn, reps, warmup, device, wall=False)


def wall_ms(fn, reps: int, warmup: int = 0, device=None) -> list[float]:
    """Milliseconds of each of `reps` calls of fn() after `warmup` untimed ones, as wall time
    with the device synchronized before and after each call (host launches included)."""
    return _time_ms(fn, reps, warmup, device, wall=True)
