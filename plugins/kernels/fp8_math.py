"""The FP8 quantization step the kernels share: x / scale, saturated to +-448, rounded to
e4m3 (imported only where Triton and a GPU are)."""

import triton
import triton.language as tl


@triton.jit
def div_scale(x, s, r):
    """x / s, given r = div_rn(1, s) computed once per scale: x * r corrected by one fused
    multiply-add (the remainder x - q * s is exact in an FMA; Markstein's step), which gives
    the correctly rounded quotient that div_rn gives, save rare corner cases, where the two
    are one fp32 unit apart and the e4m3 code moves only at a rounding tie. The per-element
    div_rn was most of these kernels' instructions, and they are instruction-bound at the rank
    slice: LN + modulate + residual + quant 19.7 -> 14.3 us, SwiGLU + quant 18.0 -> 15.6 us,
    both bit-identical to div_rn (scripts/bench_kernels.py, tests/test_kernels.py)."""
    q = x * r
    return tl.math.fma(tl.math.fma(-q, s, x), r, q)


@triton.jit
def to_e4m3(x, s, r):
    """x (fp32) quantized with scale s (r = div_rn(1, s)): clamp(x / s, +-448) as e4m3."""
    return tl.clamp(div_scale(x, s, r), -448.0, 448.0).to(tl.float8e4nv)
