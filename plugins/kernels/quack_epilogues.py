"""CuTe DSL GEMM epilogues for QuACK's persistent, warp-specialized Hopper GEMM
(plugins/quack_gemm.py; imported only where quack and a GPU are)."""

from quack.epilogue.frontend import gemm_epilogue


@gemm_epilogue()
def rowwise_scaled(acc, sa, sw):
    """D = acc * a_scale[m] * w_scale[n]: the FP8 GEMM with per-token and per-channel
    scales, as torch._scaled_mm's rowwise mode."""
    return {"D": acc * sa * sw}
