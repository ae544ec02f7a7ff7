"""On a GPU, the step time charrun reports is the step's GPU time (skipped without CUDA).

A graphed LiveTalk chunk returns to the host in a few milliseconds while its kernels run for
about a hundred; the figure /metrics, the page and the render's summary show must be the
latter. The chunks are diffused through the worker's own pipeline stage (what a live session
and a render run, `Worker.pipeline`), each reporting its `Timed` span, while torch's profiler
records the same chunks' kernels: the reported time is within 5% of the profiled chunk's (the
host's time to launch each chunk is kept beside them in the failure's message)."""

import statistics
import time

import pytest
import torch

from charengine.runtime.engine import Engine
from charengine.runtime.worker import Worker
from engines import build_target

pytestmark = pytest.mark.gpu
CHUNKS = 8  # steady chunks timed (after the cache has filled)
WARM = 6  # chunks diffused first: the cache's filling ones, then steady
GAP_S = 0.02  # idle time between timed chunks, which separates them in the profile
TOLERANCE = 0.05
PRESET_GB = 20  # the GPU memory livetalk-1.3b needs; a smaller GPU runs the tiny preset


def _engine(tmp_path):
    props = torch.cuda.get_device_properties(0)
    arch = f"sm_{props.major}{props.minor}"
    big = props.total_memory >= PRESET_GB * 2**30
    return build_target(tmp_path, "h200-livetalk" if big else "cpu-tiny-livetalk",
                        device="cuda", gpu=props.name, gpu_arch=arch)


def _chunk_spans_us(prof) -> list[float]:
    """Each timed chunk's span on the GPU in the profile (first kernel's start to last
    kernel's end, host-to-device copies of the inputs left out): the kernels grouped by the
    idle gaps between chunks."""
    kernels = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA
                     and "HtoD" not in e.name)
    groups = [[kernels[0]]]
    for start, end in kernels[1:]:
        if start - max(e for _, e in groups[-1]) > 0.5 * GAP_S * 1e6:
            groups.append([])
        groups[-1].append((start, end))
    return [max(e for _, e in g) - min(s for s, _ in g) for g in groups]


def test_the_reported_step_time_is_the_steps_gpu_time(tmp_path):
    from torch.profiler import ProfilerActivity, profile

    worker = Worker(Engine.load(_engine(tmp_path)))
    shapes = worker.family.step_shapes(worker.spec)
    feats = torch.randn(shapes.features)
    image = torch.rand(3, worker.spec.out_h, worker.spec.out_w)
    with torch.inference_mode():
        worker.start(image, "")
        pipeline = worker.pipeline(lambda i: feats)
        for i in range(WARM):
            pipeline.diffuse(i, feats).span.seconds(wait=True)
        torch.cuda.synchronize()
        reported, launched = [], []
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(WARM, WARM + CHUNKS):
                t0 = time.perf_counter()
                item = pipeline.diffuse(i, feats)
                launched.append(time.perf_counter() - t0)
                reported.append(item.span.seconds(wait=True))
                torch.cuda.synchronize()
                time.sleep(GAP_S)
    spans = _chunk_spans_us(prof)
    assert len(spans) == CHUNKS, (len(spans), spans)
    profiled = statistics.median(spans) / 1e6
    got = statistics.median(reported)
    assert abs(got - profiled) <= TOLERANCE * profiled, (got, profiled, spans, reported,
                                                         launched)
