"""The plugin kernels as torch custom ops, namespace `charengine`: each op's CUDA kernel is the
Triton kernel, its CPU kernel the plain PyTorch reference, and its fake kernel gives output
shapes to tracers (torch.compile, export). A plugin's `select` returns its op where the
plugin's switch is on, so the choice is made once, at model build, and the op then runs the
kernel or the reference by the device of its inputs.

    torch.ops.charengine.norm_modulate_quant(h, shift, scale, eps)

The fused GEMM + all-reduce is not among them: it holds its TP group's symmetric buffers
(plugins/gemm_allreduce.py), which an op's schema cannot carry.
"""

from __future__ import annotations

import torch
from torch import Tensor

from charengine import fp8

from . import act_quant as aq
from . import attention as attn
from . import delta_rotation as dr
from . import fp8_gemm as gemm
from . import pre_attention as pa

NAMESPACE = "charengine"


def _rows_scale(x: Tensor, cols: int) -> tuple[Tensor, Tensor]:
    return (x.new_empty((x.shape[0], cols), dtype=fp8.FP8),
            x.new_empty((x.shape[0], 1), dtype=torch.float32))


# ---- per-token activation quantization ---------------------------------------------------
@torch.library.custom_op(f"{NAMESPACE}::act_quant", mutates_args=())
def act_quant(x: Tensor) -> tuple[Tensor, Tensor]:
    return aq.reference(x)


@act_quant.register_kernel("cuda")
def _(x):
    return aq.triton_act_quant(x)


@act_quant.register_fake
def _(x):
    return _rows_scale(x, x.shape[1])


@torch.library.custom_op(f"{NAMESPACE}::norm_modulate_quant", mutates_args=())
def norm_modulate_quant(h: Tensor, shift: Tensor, scale: Tensor, eps: float
                        ) -> tuple[Tensor, Tensor]:
    return aq.norm_modulate_reference(h, shift, scale, eps)


@norm_modulate_quant.register_kernel("cuda")
def _(h, shift, scale, eps):
    return aq.triton_norm_modulate_quant(h, shift, scale, eps)


@norm_modulate_quant.register_fake
def _(h, shift, scale, eps):
    return _rows_scale(h, h.shape[1])


@torch.library.custom_op(f"{NAMESPACE}::residual_norm_modulate_quant", mutates_args=())
def residual_norm_modulate_quant(h: Tensor, o: Tensor, gate: Tensor, shift: Tensor,
                                 scale: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    return aq.residual_norm_modulate_reference(h, o, gate, shift, scale, eps)


@residual_norm_modulate_quant.register_kernel("cuda")
def _(h, o, gate, shift, scale, eps):
    return aq.triton_residual_norm_modulate_quant(h, o, gate, shift, scale, eps)


@residual_norm_modulate_quant.register_fake
def _(h, o, gate, shift, scale, eps):
    return (*_rows_scale(h, h.shape[1]), torch.empty_like(h))


@torch.library.custom_op(f"{NAMESPACE}::swiglu_quant", mutates_args=())
def swiglu_quant(attn_out: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    return aq.swiglu_reference(attn_out, gate, up)


@swiglu_quant.register_kernel("cuda")
def _(attn_out, gate, up):
    return aq.triton_swiglu(attn_out, gate, up)


@swiglu_quant.register_fake
def _(attn_out, gate, up):
    return _rows_scale(attn_out, attn_out.shape[1] + gate.shape[1])


# ---- pre-attention: norm, RoPE, quantize, ring write -------------------------------------
@torch.library.custom_op(f"{NAMESPACE}::pre_attention", mutates_args=("k_store", "v_store"))
def pre_attention(q: Tensor, k: Tensor, v: Tensor, q_norm: Tensor, k_norm: Tensor, eps: float,
                  cos: Tensor, sin: Tensor, k_store: Tensor, v_store: Tensor,
                  k_scale: Tensor | None, v_scale: Tensor | None, write_index: Tensor,
                  quantize_q: bool) -> tuple[Tensor, Tensor]:
    out = pa.reference(q, k, v, q_norm, k_norm, eps, cos, sin, k_store, v_store, k_scale,
                       v_scale, write_index, quantize_q)
    return out if quantize_q else (out, q.new_empty(0, dtype=torch.float32))


@pre_attention.register_kernel("cuda")
def _(q, k, v, q_norm, k_norm, eps, cos, sin, k_store, v_store, k_scale, v_scale, write_index,
      quantize_q):
    out = pa.triton_pre_attention(q, k, v, q_norm, k_norm, eps, cos, sin, k_store, v_store,
                                  k_scale, v_scale, write_index, quantize_q)
    return out if quantize_q else (out, q.new_empty(0, dtype=torch.float32))


@pre_attention.register_fake
def _(q, k, v, q_norm, k_norm, eps, cos, sin, k_store, v_store, k_scale, v_scale, write_index,
      quantize_q):
    H, T, D = q.shape
    if quantize_q:
        return (q.new_empty((H, T, D), dtype=fp8.FP8),
                q.new_empty((H, T, 1), dtype=torch.float32))
    return q.new_empty((H, T, D)), q.new_empty(0, dtype=torch.float32)


def pre_attention_op(q, k, v, q_norm, k_norm, eps, cos, sin, k_store, v_store, k_scale, v_scale,
                     write_index, quantize_q: bool = False):
    """The op with plugins/pre_attention.reference's signature and result."""
    out, q_scale = torch.ops.charengine.pre_attention.default(
        q, k, v, q_norm, k_norm, eps, cos, sin, k_store, v_store, k_scale, v_scale, write_index,
        quantize_q)
    return (out, q_scale) if quantize_q else out


# ---- FP8 attention over the ring ----------------------------------------------------------
@torch.library.custom_op(f"{NAMESPACE}::fp8_attention", mutates_args=())
def fp8_attention(q8: Tensor, q_scale: Tensor, k8: Tensor, v8: Tensor, k_scale: Tensor,
                  v_scale: Tensor, out_dtype: torch.dtype, tiles: str) -> Tensor:
    return attn.reference(q8, q_scale, k8, v8, k_scale, v_scale, out_dtype)


@fp8_attention.register_kernel("cuda")
def _(q8, q_scale, k8, v8, k_scale, v_scale, out_dtype, tiles):
    return attn.triton_attention(q8, q_scale, k8, v8, k_scale, v_scale, out_dtype,
                                 attn.AttentionTiles.parse(tiles))


@fp8_attention.register_fake
def _(q8, q_scale, k8, v8, k_scale, v_scale, out_dtype, tiles):
    H, T, D = q8.shape
    return q8.new_empty((T, H * D), dtype=out_dtype)


# ---- delta rotation at reset --------------------------------------------------------------
@torch.library.custom_op(f"{NAMESPACE}::delta_rotation", mutates_args=("k8",))
def delta_rotation(k8: Tensor, k_scale: Tensor, first_slot: int, omega_t: Tensor,
                   delta: float) -> None:
    dr.reference(k8, k_scale, first_slot, omega_t, delta)


@delta_rotation.register_kernel("cuda")
def _(k8, k_scale, first_slot, omega_t, delta):
    dr.triton_delta_rotation(k8, k_scale, first_slot, omega_t, delta)


@delta_rotation.register_fake
def _(k8, k_scale, first_slot, omega_t, delta):
    return None


# ---- the Triton FP8 GEMM (the per-shape plan's other choice) -----------------------------
@torch.library.custom_op(f"{NAMESPACE}::fp8_gemm", mutates_args=())
def fp8_gemm(a_q: Tensor, a_scale: Tensor, w_q: Tensor, w_scale: Tensor,
             out_dtype: torch.dtype) -> Tensor:
    return gemm.reference(a_q, a_scale, w_q, w_scale, out_dtype)


@fp8_gemm.register_kernel("cuda")
def _(a_q, a_scale, w_q, w_scale, out_dtype):
    return gemm.triton_scaled_mm(a_q, a_scale, w_q, w_scale, out_dtype)


@fp8_gemm.register_fake
def _(a_q, a_scale, w_q, w_scale, out_dtype):
    return a_q.new_empty((a_q.shape[0], w_q.shape[0]), dtype=out_dtype)
