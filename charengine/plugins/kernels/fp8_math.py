"""The FP8 quantization step the kernels share: x / scale, saturated to +-FP8_MAX, rounded to
e4m3, and the constants every kernel takes from charengine/fp8.py (imported only where Triton
and a GPU are)."""

import triton
import triton.language as tl

from charengine import fp8

# Module globals a @triton.jit function reads must be tl.constexpr. Each kernel module imports
# these names, so that its own functions can read them.
FP8_MAX = tl.constexpr(fp8.FP8_MAX)  # e4m3's largest finite value (448)
AMAX_FLOOR = tl.constexpr(fp8.TINY)  # the least amax a scale is taken from (an all-zero row)


@triton.jit
def scale_of(amax):
    """The scale an amax (fp32, any shape) gives, as charengine/fp8.scale_of computes it: the
    amax floored at AMAX_FLOOR, over FP8_MAX."""
    return tl.maximum(amax, AMAX_FLOOR) / FP8_MAX


@triton.jit
def div_scale(x, s, r):
    """x / s, given r = div_rn(1, s) computed once per scale: x * r corrected by one fused
    multiply-add (the remainder x - q * s is exact in an FMA; Markstein's step), which gives
    the correctly rounded quotient that div_rn gives, save rare corner cases, where the two
    are one fp32 unit apart and the e4m3 code moves only at a rounding tie. The per-element
    div_rn was most of these kernels' instructions, and they are instruction-bound at the rank
    slice; the kernels stay bit-identical to div_rn (tests/test_act_quant.py,
    tests/test_kernels.py; the timings: docs/PERFORMANCE_LOG.md, "Kernels alone")."""
    q = x * r
    return tl.math.fma(tl.math.fma(-q, s, x), r, q)


@triton.jit
def to_e4m3(x, s, r):
    """x (fp32) quantized with scale s (r = div_rn(1, s)): clamp(x / s, +-FP8_MAX) as e4m3.
    The conversion saturates (cvt.rn.satfinite on Hopper and Blackwell: finite values past
    the range become +-FP8_MAX), so it is the clamp, at no instruction of its own."""
    return div_scale(x, s, r).to(tl.float8e4nv)
