"""The plugin kernels as torch operators, namespace `charengine`: each op's CUDA kernel is the
Triton kernel, its CPU kernel the plain PyTorch reference, and its fake kernel gives output
shapes to tracers (torch.compile, export). A plugin's `select` returns its op where the
plugin's switch is on, so the choice is made once, at model build, and the op then runs the
kernel or the reference by the device of its inputs.

    torch.ops.charengine.norm_modulate_quant.default(h, shift, scale, eps)

Registered through torch.library.Library with explicit schemas rather than the
`torch.library.custom_op` decorator: that one wraps every kernel in a dynamo guard whose first
call imports torch._dynamo and sympy (seconds more at worker start), and costs several times
more per call (docs/PERFORMANCE.md has the numbers).

The fused GEMM + all-reduce is not among them: it holds its TP group's symmetric buffers
(plugins/gemm_allreduce.py), which an op's schema cannot carry.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.library import Library, register_fake

from charengine import fp8

from . import act_quant as aq
from . import attention as attn
from . import calibrate as cal
from . import delta_rotation as dr
from . import fp8_gemm as gemm
from . import pre_attention as pa

NAMESPACE = "charengine"

SCHEMAS = {
    "act_quant": "(Tensor x) -> (Tensor, Tensor)",
    "norm_modulate_quant": "(Tensor h, Tensor shift, Tensor scale, float eps) -> (Tensor, Tensor)",
    "residual_norm_modulate_quant": "(Tensor h, Tensor o, Tensor gate, Tensor shift, "
                                    "Tensor scale, float eps) -> (Tensor, Tensor, Tensor)",
    "swiglu_quant": "(Tensor attn_out, Tensor gate, Tensor up) -> (Tensor, Tensor)",
    "pre_attention": "(Tensor q, Tensor k, Tensor v, Tensor q_norm, Tensor k_norm, float eps, "
                     "Tensor cos, Tensor sin, Tensor(a!) k_store, Tensor(b!) v_store, "
                     "Tensor? k_scale, Tensor? v_scale, Tensor write_index, bool quantize_q) "
                     "-> (Tensor, Tensor)",
    "fp8_attention": "(Tensor q8, Tensor q_scale, Tensor k8, Tensor v8, Tensor k_scale, "
                     "Tensor v_scale, ScalarType out_dtype, str tiles) -> Tensor",
    "fp8_attention_amax": "(Tensor q8, Tensor q_scale, Tensor k8, Tensor v8, Tensor k_scale, "
                          "Tensor v_scale, ScalarType out_dtype, str tiles) -> (Tensor, Tensor)",
    "concat_quant": "(Tensor attn_out, Tensor? attn_amax, Tensor y, Tensor y_amax) "
                    "-> (Tensor, Tensor)",
    "delta_rotation": "(Tensor(a!) k8, Tensor k_scale, int first_slot, Tensor omega_t, "
                      "float delta) -> ()",
    "fp8_gemm": "(Tensor a_q, Tensor a_scale, Tensor w_q, Tensor w_scale, ScalarType out_dtype, "
                "bool fast_accum, str tiles) -> Tensor",
    "calibrate_cache": "(Tensor k, Tensor v, Tensor(a!) k8, Tensor(b!) v8, Tensor(c!) scale, "
                       "float margin, float fp8_max) -> ()",
}


def _rows_scale(x: Tensor, cols: int) -> tuple[Tensor, Tensor]:
    return (x.new_empty((x.shape[0], cols), dtype=fp8.FP8),
            x.new_empty((x.shape[0], 1), dtype=torch.float32))


def _no_scale(q: Tensor) -> Tensor:
    return q.new_empty(0, dtype=torch.float32)


def _pre_attention(kernel):
    def run(q, k, v, q_norm, k_norm, eps, cos, sin, k_store, v_store, k_scale, v_scale,
            write_index, quantize_q):
        out = kernel(q, k, v, q_norm, k_norm, eps, cos, sin, k_store, v_store, k_scale, v_scale,
                     write_index, quantize_q)
        return out if quantize_q else (out, _no_scale(q))
    return run


def _pre_attention_fake(q, k, v, q_norm, k_norm, eps, cos, sin, k_store, v_store, k_scale,
                        v_scale, write_index, quantize_q):
    H, T, D = q.shape
    if quantize_q:
        return (q.new_empty((H, T, D), dtype=fp8.FP8),
                q.new_empty((H, T, 1), dtype=torch.float32))
    return q.new_empty((H, T, D)), _no_scale(q)


def _gemm_kernel(a_q, a_scale, w_q, w_scale, out_dtype, fast_accum, tiles):
    return gemm.triton_scaled_mm(a_q, a_scale, w_q, w_scale, out_dtype,
                                 gemm.GemmTiles.parse(tiles), fast_accum)


def _gemm_reference(a_q, a_scale, w_q, w_scale, out_dtype, fast_accum, tiles):
    """The exact emulation: fp32 sums of exact products (no reduced-precision accumulator)."""
    return gemm.reference(a_q, a_scale, w_q, w_scale, out_dtype)


def _attention_kernel(q8, q_scale, k8, v8, k_scale, v_scale, out_dtype, tiles):
    return attn.triton_attention(q8, q_scale, k8, v8, k_scale, v_scale, out_dtype,
                                 attn.AttentionTiles.parse(tiles))


def _attention_amax_kernel(q8, q_scale, k8, v8, k_scale, v_scale, out_dtype, tiles):
    H, T, _ = q8.shape
    amax = torch.empty((H, T), dtype=torch.float32, device=q8.device)
    out = attn.triton_attention(q8, q_scale, k8, v8, k_scale, v_scale, out_dtype,
                                attn.AttentionTiles.parse(tiles), amax=amax)
    return out, amax.t()


def _attention_amax_reference(q8, q_scale, k8, v8, k_scale, v_scale, out_dtype, tiles):
    return attn.reference_amax(q8, q_scale, k8, v8, k_scale, v_scale, out_dtype)


def _attention_amax_fake(q8, q_scale, k8, v8, k_scale, v_scale, out_dtype, tiles):
    H, T, D = q8.shape
    return (q8.new_empty((T, H * D), dtype=out_dtype),
            q8.new_empty((H, T), dtype=torch.float32).t())


def _attention_reference(q8, q_scale, k8, v8, k_scale, v_scale, out_dtype, tiles):
    return attn.reference(q8, q_scale, k8, v8, k_scale, v_scale, out_dtype)


def _attention_fake(q8, q_scale, k8, v8, k_scale, v_scale, out_dtype, tiles):
    H, T, D = q8.shape
    return q8.new_empty((T, H * D), dtype=out_dtype)


# name: (CPU kernel = the reference, CUDA kernel = Triton, fake kernel)
KERNELS = {
    "act_quant": (aq.reference, aq.triton_act_quant, lambda x: _rows_scale(x, x.shape[1])),
    "norm_modulate_quant": (aq.norm_modulate_reference, aq.triton_norm_modulate_quant,
                            lambda h, shift, scale, eps: _rows_scale(h, h.shape[1])),
    "residual_norm_modulate_quant": (
        aq.residual_norm_modulate_reference, aq.triton_residual_norm_modulate_quant,
        lambda h, o, gate, shift, scale, eps: (*_rows_scale(h, h.shape[1]), torch.empty_like(h))),
    "swiglu_quant": (aq.swiglu_reference, aq.triton_swiglu,
                     lambda a, gate, up: _rows_scale(a, a.shape[1] + gate.shape[1])),
    "pre_attention": (_pre_attention(pa.reference), _pre_attention(pa.triton_pre_attention),
                      _pre_attention_fake),
    "fp8_attention": (_attention_reference, _attention_kernel, _attention_fake),
    "fp8_attention_amax": (_attention_amax_reference, _attention_amax_kernel,
                           _attention_amax_fake),
    "concat_quant": (aq.concat_quant_reference, aq.triton_concat_quant,
                     lambda a, am, y, ym: _rows_scale(a, a.shape[1] + y.shape[1])),
    "delta_rotation": (dr.reference, dr.triton_delta_rotation, lambda *args: None),
    "fp8_gemm": (_gemm_reference, _gemm_kernel,
                 lambda a_q, a_s, w_q, w_s, out_dtype, fast_accum, tiles: a_q.new_empty(
                     (a_q.shape[0], w_q.shape[0]), dtype=out_dtype)),
    "calibrate_cache": (cal.reference, cal.triton_calibrate, lambda *args: None),
}

def _register(lib: Library) -> Library:
    for name, (cpu, cuda, fake) in KERNELS.items():
        lib.define(name + SCHEMAS[name])
        lib.impl(name, cpu, "CPU")
        lib.impl(name, cuda, "CUDA")
        register_fake(f"{NAMESPACE}::{name}", fake, lib=lib)
    return lib


LIB = _register(Library(NAMESPACE, "DEF"))  # the registrations live as long as this module


def pre_attention_op(q, k, v, q_norm, k_norm, eps, cos, sin, k_store, v_store, k_scale, v_scale,
                     write_index, quantize_q: bool = False):
    """The op with plugins/pre_attention.reference's signature and result."""
    out, q_scale = torch.ops.charengine.pre_attention.default(
        q, k, v, q_norm, k_norm, eps, cos, sin, k_store, v_store, k_scale, v_scale, write_index,
        quantize_q)
    return (out, q_scale) if quantize_q else out
