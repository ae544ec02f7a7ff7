"""CuTe DSL GEMM epilogues for QuACK's persistent, warp-specialized Hopper GEMM
(plugins/quack_gemm.py; imported only where quack and a GPU are)."""

from quack.activation import swiglu
from quack.epilogue.frontend import gemm_epilogue
from quack.epilogue.math import pack, unpack
from quack.epilogue.ops import ColVecReduce


@gemm_epilogue()
def rowwise_scaled(acc, sa, sw):
    """D = acc * a_scale[m] * w_scale[n]: the FP8 GEMM with per-token and per-channel
    scales, as torch._scaled_mm's rowwise mode."""
    return {"D": acc * sa * sw}


@gemm_epilogue()
def rowwise_scaled_residual(acc, c, sa, sw):
    """D = acc * a_scale[m] * w_scale[n] + C, rounded once: the output projection with the
    block's gated residual (the gate folded into w_scale; C is the residual stream)."""
    return {"D": acc * sa * sw + c}


@gemm_epilogue(outputs=("postact",), reduces={"amax": ColVecReduce("amax", combine="max_abs")},
               mode="acc_pair")
def rowwise_swiglu(acc, sa, sw):
    """The SwiGLU half of the input projection: the scaled accumulator's adjacent columns
    are (gate, up) pairs; postact = silu(gate) * up (half of GEMM-N, rounded once), and
    each row's |postact| max per N tile (fp32, before rounding) for the quantization of the
    output projection's input, which then needs no reduction over the row."""
    g, u = unpack(acc * sa * sw)
    y = swiglu(g, u)
    return {"postact": y, "amax": (y, y)}  # a paired mode's reduce takes both lanes


@gemm_epilogue(outputs=("postact",), reduces={"amax": ColVecReduce("amax", combine="max_abs")},
               mode="acc_pair")
def rowwise_swiglu_d(acc, sa, sw):
    """rowwise_swiglu that also writes the scaled product (D, every column): the input
    projection in one GEMM, its q/k/v columns read from D and its MLP from postact."""
    g, u = unpack(acc * sa * sw)
    y = swiglu(g, u)
    return {"D": pack(g, u), "postact": y, "amax": (y, y)}
