"""cuBLASLt's FP8 matmul through its C API (ctypes, on the library torch has loaded): the
kernel `torch._scaled_mm` runs, with the rowwise (outer-vector) scales it uses, plus what
`_scaled_mm` does not expose: a C matrix added in the epilogue, D = (A B) + C, at no measured
cost at the output projection (scripts/bench_gemm_modes.py, docs/PERFORMANCE_LOG.md).

Row-major D [M, N] = (a [M, K] * sa [M]) (w [N, K] * sw [N])^T (+ C [M, N]) is cuBLASLt's
column-major D^T = op(W) A^T: its "A" is the weight (transposed), its "B" the activations.
GPU only; `Matmul` objects are made per shape by plugins/gemm_residual.py.
"""

from __future__ import annotations

import ctypes

import torch

from charengine import cuda_libs

# cublasLt.h, library_types.h, cublas_api.h (CUDA 12 and 13 agree on these values)
R_32F, R_16F, R_16BF, R_E4M3 = 0, 2, 14, 28
COMPUTE_32F = 68
DESC_TRANSA, DESC_TRANSB, DESC_A_SCALE, DESC_B_SCALE, DESC_FAST_ACCUM = 3, 4, 17, 18, 25
DESC_EPILOGUE, DESC_BIAS_POINTER, DESC_BIAS_DATA_TYPE, EPILOGUE_BIAS = 7, 8, 26, 4
DESC_A_SCALE_MODE, DESC_B_SCALE_MODE, SCALE_OUTER_VEC_32F = 31, 32, 3
PREF_MAX_WORKSPACE = 1
OUT_TYPES = {torch.bfloat16: R_16BF, torch.float16: R_16F, torch.float32: R_32F}
CONFIG_ATTRS = (("id", 0, ctypes.c_int32), ("tile", 1, ctypes.c_uint32),
                ("splitk", 2, ctypes.c_int32), ("custom", 5, ctypes.c_uint32),
                ("stages", 6, ctypes.c_uint32), ("cluster", 8, ctypes.c_uint16))


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Heuristic(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def load() -> ctypes.CDLL:
    """The libcublasLt torch uses: loaded already, else after a rowwise `_scaled_mm` loads
    it."""
    lib = cuda_libs.loaded("libcublasLt")
    if lib is not None:
        return lib
    z = torch.zeros(16, 16, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    torch._scaled_mm(z, z.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    lib = cuda_libs.loaded("libcublasLt")
    if lib is None:
        raise RuntimeError("libcublasLt is not loaded in this process (torch built without "
                           "CUDA?)")
    return lib


def check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLASLt {what} failed with status {status}")


class Handle:
    """The library and one cuBLASLt handle, with a workspace its matmuls share (calls are
    ordered on the caller's stream)."""

    def __init__(self, device: torch.device, workspace_bytes: int):
        self.lib = load()
        self.handle = ctypes.c_void_p()
        check(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "create")
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)

    def __del__(self):
        if getattr(self, "handle", None) and self.handle.value:
            self.lib.cublasLtDestroy(self.handle)


class Matmul:
    """One shape and numerics: D [M, N] = (a [M, K] * sa [M]) (w [N, K] * sw [N])^T, plus
    C [M, N] (beta = 1) when `with_c`, plus a bias row [N] when `with_bias`. The algorithm is cuBLASLt's heuristic choice, picked
    once, at the first call (the heuristic needs the scale pointers set; it offers one
    algorithm at the rank-slice shapes: docs/PERFORMANCE_LOG.md)."""

    def __init__(self, h: Handle, M: int, N: int, K: int, out_dtype: torch.dtype,
                 fast_accum: bool, with_c: bool, with_bias: bool = False):
        if out_dtype not in OUT_TYPES:
            raise ValueError(f"cuBLASLt FP8 output dtype {out_dtype} not among {list(OUT_TYPES)}")
        self.h, self.M, self.N, self.K, self.out_dtype = h, M, N, K, out_dtype
        lib = h.lib
        self.desc = ctypes.c_void_p()
        check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), COMPUTE_32F, R_32F),
              "matmul descriptor")
        for attr, value, ct in ((DESC_TRANSA, 1, ctypes.c_int32), (DESC_TRANSB, 0, ctypes.c_int32),
                                (DESC_A_SCALE_MODE, SCALE_OUTER_VEC_32F, ctypes.c_int32),
                                (DESC_B_SCALE_MODE, SCALE_OUTER_VEC_32F, ctypes.c_int32),
                                (DESC_FAST_ACCUM, int(fast_accum), ctypes.c_int8)):
            self._set(attr, ct(value))
        self.layouts = [self._layout(R_E4M3, K, N, K), self._layout(R_E4M3, K, M, K),
                        self._layout(OUT_TYPES[out_dtype], N, M, N)]
        if with_bias:  # a bias [N] in the output dtype, added before the one rounding
            self._set(DESC_EPILOGUE, ctypes.c_int32(EPILOGUE_BIAS))
            self._set(DESC_BIAS_DATA_TYPE, ctypes.c_int32(OUT_TYPES[out_dtype]))
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(1.0 if with_c else 0.0)
        self.with_c, self.with_bias = with_c, with_bias
        self.heuristic: Heuristic | None = None

    def _set(self, attr: int, value) -> None:
        check(self.h.lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(value),
                                                        ctypes.sizeof(value)), f"attribute {attr}")

    def _layout(self, dtype: int, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        out = ctypes.c_void_p()
        check(self.h.lib.cublasLtMatrixLayoutCreate(ctypes.byref(out), dtype,
                                                    ctypes.c_uint64(rows), ctypes.c_uint64(cols),
                                                    ctypes.c_int64(ld)), "layout")
        return out

    def _scales(self, sa: torch.Tensor, sw: torch.Tensor) -> None:
        self._set(DESC_A_SCALE, ctypes.c_void_p(sw.data_ptr()))  # cuBLASLt's A is the weight
        self._set(DESC_B_SCALE, ctypes.c_void_p(sa.data_ptr()))

    def heuristics(self, sa: torch.Tensor, sw: torch.Tensor, n: int = 1) -> list[Heuristic]:
        """Up to n algorithms, best first, that fit the handle's workspace, for these scales."""
        self._scales(sa, sw)
        lib, pref = self.h.lib, ctypes.c_void_p()
        check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        size = ctypes.c_uint64(self.h.workspace.numel())
        check(lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE,
                                                       ctypes.byref(size), 8), "preference")
        res, count = (Heuristic * n)(), ctypes.c_int()
        a, b, c = self.layouts
        status = lib.cublasLtMatmulAlgoGetHeuristic(self.h.handle, self.desc, a, b, c, c, pref,
                                                    n, res, ctypes.byref(count))
        lib.cublasLtMatmulPreferenceDestroy(pref)
        check(status, "heuristic")
        return [res[i] for i in range(count.value) if res[i].state == 0]

    def _heuristic(self, sa: torch.Tensor, sw: torch.Tensor) -> Heuristic:
        found = self.heuristics(sa, sw)
        if not found:
            raise ValueError(f"cuBLASLt has no FP8 algorithm for M, N, K = "
                               f"{self.M}, {self.N}, {self.K}")
        return found[0]

    def config(self, h: Heuristic | None = None) -> dict:
        """The algorithm's id, tile, split-K, custom option, stages and cluster as cuBLASLt
        reports them."""
        h = h or self.heuristic
        if h is None:
            raise ValueError("no algorithm chosen yet: call the matmul or pass a heuristic")
        out = {}
        for name, attr, ct in CONFIG_ATTRS:
            v, n = ct(), ctypes.c_size_t()
            self.h.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(h.algo), attr,
                                                            ctypes.byref(v), ctypes.sizeof(v),
                                                            ctypes.byref(n))
            out[name] = v.value
        return {**out, "workspace": h.workspace, "waves": round(h.waves, 2)}

    def __call__(self, a: torch.Tensor, sa: torch.Tensor, w: torch.Tensor, sw: torch.Tensor,
                 c: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 heuristic: Heuristic | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        """a [M, K] e4m3, sa M fp32, w [N, K] e4m3, sw N fp32, all contiguous; c [M, N] in the
        output dtype where this matmul adds one (it may be `out`); bias [N] in the output
        dtype where it adds one."""
        if (c is not None) != self.with_c:
            raise ValueError("this matmul adds C: pass c" if self.with_c
                             else "this matmul was made without C")
        if (bias is not None) != self.with_bias:
            raise ValueError("this matmul adds a bias: pass bias" if self.with_bias
                             else "this matmul was made without a bias")
        if bias is not None:
            self._set(DESC_BIAS_POINTER, ctypes.c_void_p(bias.data_ptr()))
        d = out if out is not None else torch.empty(self.M, self.N, dtype=self.out_dtype,
                                                    device=a.device)
        if heuristic is None and self.heuristic is None:
            self.heuristic = self._heuristic(sa, sw)
        self._scales(sa, sw)
        p, (la, lb, lc) = ctypes.c_void_p, self.layouts
        cp = p((c if c is not None else d).data_ptr())
        ws = self.h.workspace
        check(self.h.lib.cublasLtMatmul(
            self.h.handle, self.desc, ctypes.byref(self.alpha), p(w.data_ptr()), la,
            p(a.data_ptr()), lb, ctypes.byref(self.beta), cp, lc, p(d.data_ptr()), lc,
            ctypes.byref((heuristic or self.heuristic).algo), p(ws.data_ptr()),
            ctypes.c_size_t(ws.numel()), p(torch.cuda.current_stream(a.device).cuda_stream)),
            "matmul")
        return d

    def __del__(self):
        lib = self.h.lib
        for layout in getattr(self, "layouts", []):
            lib.cublasLtMatrixLayoutDestroy(layout)
        if getattr(self, "desc", None) and self.desc.value:
            lib.cublasLtMatmulDescDestroy(self.desc)


class Gemm:
    """The FP8 GEMM (with its bias, or a C input, in the epilogue where one is given) through
    cuBLASLt, in `fp8.scaled_mm`'s signature: one Matmul per shape and numerics, made at its
    first call, over a workspace of `workspace_bytes`. With none, cuBLASLt takes only
    algorithms that need no workspace, and so issues no memset of it before each matmul
    (one more node and its gap in a CUDA graph: docs/PERFORMANCE_LOG.md)."""

    def __init__(self, device: torch.device, workspace_bytes: int = 0):
        self.handle = Handle(device, workspace_bytes)
        self.matmuls: dict[tuple, Matmul] = {}

    def __call__(self, a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor,
                 w_scale: torch.Tensor, out_dtype: torch.dtype, fast_accum: bool = False,
                 bias: torch.Tensor | None = None, c: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """c [M, N] in out_dtype, if given, is added to the product (beta = 1)."""
        M, K = a_q.shape
        N = w_q.shape[0]
        if not (a_q.is_contiguous() and w_q.is_contiguous()):
            raise ValueError("a_q and w_q must be contiguous")
        key = (M, N, K, out_dtype, fast_accum, c is not None, bias is not None)
        if key not in self.matmuls:
            self.matmuls[key] = Matmul(self.handle, *key)
        return self.matmuls[key](a_q, a_scale.float().reshape(M).contiguous(), w_q,
                                 w_scale.float().reshape(N).contiguous(), c, bias=bias)
