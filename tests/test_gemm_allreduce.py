"""The fused FP8 GEMM + all-reduce (plugins/gemm_allreduce.py): its dispatch rules on CPU;
on one GPU the GEMM and its exchange epilogue at world size one and with three ranks'
buffers on the same device (every slot, flag and epoch as across GPUs); on two GPUs, real
processes over symmetric memory against NCCL (skipped with fewer GPUs)."""

import os

import pytest
import torch

from charengine import fp8
from charengine.config import preset
from charengine.plugins import gemm_allreduce as gar

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_the_fused_kernel_serves_only_the_steady_shape_of_a_gpu_group():
    steady = (757, 7680)
    assert gar.use_fused(CUDA, 3, steady, steady, True)
    assert not gar.use_fused(CUDA, 3, (1246, 7680), steady, True)  # session start: NCCL
    assert not gar.use_fused(CUDA, 1, steady, steady, True)  # nothing to reduce
    assert not gar.use_fused(CPU, 3, steady, steady, True)  # gloo
    assert not gar.use_fused(CUDA, 3, steady, steady, False)  # no symmetric memory


def test_other_shapes_take_the_gemm_then_all_reduce_path():
    """A rank's fused op called at the session start's shape is the reference path: the
    GEMM, then the group's all-reduce (here a sum over three CPU 'ranks')."""
    spec = preset("tiny").model
    x = gar.Exchange.local(3, spec.tokens_per_frame, spec.dim, CPU)[0]
    op = gar.SymmetricGemmAllReduce(x)
    assert op.steady == (spec.tokens_per_frame, spec.dim)
    g = torch.Generator().manual_seed(0)
    aq, a_s = fp8.quantize_rows(torch.randn(spec.global_tokens, 2 * spec.dim, generator=g))
    wq, ws = fp8.quantize_rows(torch.randn(spec.dim, 2 * spec.dim, generator=g))
    calls = []

    def all_reduce(t):
        calls.append(t.shape)
        return 3 * t

    out = op(aq, a_s, wq, ws[:, 0].contiguous(), torch.float32, False, all_reduce)
    assert calls == [(spec.global_tokens, spec.dim)]
    want = 3 * fp8.scaled_mm(aq, a_s, wq, ws[:, 0].contiguous(), torch.float32)
    assert torch.equal(out, want)


def operands(m, k, n, g, device=CUDA):
    aq, a_s = fp8.quantize_rows(torch.randn(m, k, device=device, generator=g))
    wq, ws = fp8.quantize_rows(torch.randn(n, k, device=device, generator=g))
    return aq, a_s, wq, ws[:, 0].contiguous()


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(757, 12800, 7680), (77, 320, 208)])  # K, N: 16s (cuBLASLt)
def test_world_size_one_is_the_gemm(m, k, n):
    from charengine.plugins.fp8_gemm import triton_scaled_mm

    g = torch.Generator(device=CUDA).manual_seed(1)
    (x,) = gar.Exchange.local(1, m, n, CUDA)
    x.data.fill_(float("nan"))
    for _ in range(3):  # epochs and both parities
        aq, a_s, wq, ws = operands(m, k, n, g)
        gar.gemm_push(x, aq, a_s, wq, ws)
        out = gar.reduce(x, torch.bfloat16)
        assert torch.equal(out, triton_scaled_mm(aq, a_s, wq, ws, torch.bfloat16))
        assert rel(out, fp8.scaled_mm(aq, a_s, wq, ws, torch.float32)) < 1e-2
    assert x.epoch.item() == 3


@pytest.mark.gpu
def test_three_ranks_buffers_on_one_gpu_reduce_to_the_full_product():
    """Row-parallel: rank r holds K columns r; every rank pushes, then each reduces. All
    ranks end with the same output, the full product to bf16 rounding of the partials."""
    m, k, n, world = 757, 3 * 640, 1008, 3
    g = torch.Generator(device=CUDA).manual_seed(2)
    xs = gar.Exchange.local(world, m, n, CUDA)
    for x in xs:
        x.data.fill_(float("nan"))
    for _ in range(3):
        a = torch.randn(m, k, device=CUDA, generator=g)
        w = torch.randn(n, k, device=CUDA, generator=g)
        full = a @ w.t()
        parts = []
        for r, x in enumerate(xs):
            aq, a_s = fp8.quantize_rows(a[:, r::world].contiguous())
            wq, ws = fp8.quantize_rows(w[:, r::world].contiguous())
            parts.append(fp8.scaled_mm(aq, a_s, wq, ws[:, 0].contiguous(), torch.float32))
            gar.gemm_push(x, aq, a_s, wq, ws[:, 0].contiguous())
        h = (torch.randn(m, n, device=CUDA, generator=g) * 30).to(torch.bfloat16)
        outs = [gar.reduce(x, torch.bfloat16, residual=h) for x in xs]
        assert all(torch.equal(outs[0], o) for o in outs[1:])
        assert rel(outs[0].float() - h.float(), sum(parts)) < 1e-2  # h added once
        assert rel(outs[0].float() - h.float(), full) < 6e-2  # FP8 operands


@pytest.mark.gpu
def test_the_exchange_replays_from_a_cuda_graph():
    m, k, n = 757, 1024, 768
    g = torch.Generator(device=CUDA).manual_seed(3)
    (x,) = gar.Exchange.local(1, m, n, CUDA)
    aq, a_s, wq, ws = operands(m, k, n, g)
    gar.gemm_push(x, aq, a_s, wq, ws)
    gar.reduce(x, torch.bfloat16)  # compiled and loaded before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gar.gemm_push(x, aq, a_s, wq, ws)
        out = gar.reduce(x, torch.bfloat16)
    for _ in range(3):
        new = operands(m, k, n, g)
        for dst, src in zip((aq, a_s, wq, ws), new):
            dst.copy_(src)
        graph.replay()
        assert rel(out, fp8.scaled_mm(*new, torch.float32)) < 1e-2


def _two_gpu_rank(rank, port, result):
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    m, k, n = 757, 6400, 7680
    op = gar.SymmetricGemmAllReduce(gar.Exchange.symmetric(group, m, n, torch.device("cuda")))
    g = torch.Generator(device="cuda").manual_seed(10 + rank)
    errs = []
    for _ in range(5):
        aq, a_s, wq, ws = operands(m, k, n, g)

        def nccl(t):
            dist.all_reduce(t)
            return t

        fused = op(aq, a_s, wq, ws, torch.bfloat16, False, nccl)
        plain = gar.reference(aq, a_s, wq, ws, torch.float32, False, nccl)
        errs.append(rel(fused, plain))
        h = (torch.randn(m, n, device="cuda", generator=torch.Generator(device="cuda")
                         .manual_seed(len(errs))) * 30).to(torch.bfloat16)  # same on both
        fused = op(aq, a_s, wq, ws, torch.bfloat16, False, nccl, residual=h)
        plain = gar.reference(aq, a_s, wq, ws, torch.float32, False, nccl,
                              h if rank == 0 else None)
        errs.append(rel(fused.float() - h.float(), plain - h.float()))
    torch.save(errs, f"{result}.{rank}")
    dist.destroy_process_group()


@pytest.mark.gpu
def test_two_gpus_fused_equals_gemm_then_nccl(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    import torch.multiprocessing as mp

    from charengine.runtime.distributed import free_port

    result = str(tmp_path / "errs")
    mp.start_processes(_two_gpu_rank, args=(free_port(), result), nprocs=2, join=True,
                       start_method="spawn")
    for r in range(2):
        errs = torch.load(f"{result}.{r}")
        assert max(errs) < 1e-2, errs
    os.remove(f"{result}.0")
