"""charbuild --export-onnx: the engine's decoder and audio encoder (its family's `onnx_graphs`)
written as ONNX into the engine's onnx/ directory, each run through onnxruntime on the CPU
against torch before the build may finish (docs/ENGINE_FORMAT.md, "ONNX").

The exporter is torch.onnx's torch.export-based one (`dynamo=True`): it traces the graphs'
Python (the causal caches, the chunk arithmetic) and refuses what it cannot express instead
of freezing it, as the TorchScript exporter, deprecated in this torch, would. Every graph is
float32 on fixed shapes (one user's session at the engine's resolution): no dynamic axes."""

from __future__ import annotations

import importlib
import logging
import warnings
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch

from charengine.engine_format import ONNX
from charengine.family import OnnxGraph, family_of

OPSET = 18  # the ONNX opset every graph is written in (onnxruntime, TensorRT 8.6 and later)
# Largest accepted max |onnxruntime - torch| of an output, relative to max(1, max |torch|),
# over every call of the check (fp32 on both sides differs by about 1e-6)
TOLERANCE = 1e-4
PROTOBUF_LIMIT = 2 << 30  # bytes: a graph with more weights keeps them in an external file
NEEDS = ("onnx", "onnxscript", "onnxruntime")  # what the export and its check import


class OnnxExportError(ValueError):
    pass


def require_onnx() -> None:
    """Refuse, in one line, an --export-onnx build where the exporter or onnxruntime is
    missing (before any work)."""
    for name in NEEDS:
        try:
            importlib.import_module(name)
        except ImportError:
            raise OnnxExportError(f"--export-onnx needs {name}, which does not import here: "
                                  "pip install 'charengine[onnx]'") from None


@contextmanager
def quiet():
    """The exporter's progress lines and warnings kept out of charbuild's output (a failure
    still raises)."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def one_line(e: BaseException) -> str:
    """The innermost cause of an exporter error, as one line."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def outputs_of(module: torch.nn.Module, inputs: dict, names) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        out = module(*(inputs[n] for n in names))
    return out if isinstance(out, tuple) else (out,)


def export_graph(graph: OnnxGraph, path: Path, metadata: dict) -> None:
    """Write `graph` to `path` at OPSET (OnnxExportError, one line, where it cannot be)."""
    args = tuple(graph.calls[0][n] for n in graph.inputs)
    weights = sum(t.numel() * t.element_size() for t in graph.module.state_dict().values())
    try:
        with quiet():
            program = torch.onnx.export(graph.module, args, dynamo=True, opset_version=OPSET,
                                        input_names=list(graph.inputs),
                                        output_names=list(graph.outputs), verbose=False)
            program.model.doc_string = graph.doc
            program.model.metadata_props.update(metadata)
            program.save(str(path), external_data=weights > PROTOBUF_LIMIT)
    except Exception as e:  # the exporter's own errors (unsupported op, tracing): one line
        raise OnnxExportError(f"--export-onnx: the {graph.name} graph cannot be exported to ONNX "
                              f"({one_line(e)})") from None


def check_graph(graph: OnnxGraph, path: Path) -> tuple[float, tuple[torch.Tensor, ...]]:
    """Run the written graph through onnxruntime on the CPU over `graph.calls`, feeding each
    carried output back as the next call's input on both sides, against the module in torch:
    the largest relative error and torch's outputs of the first call, or OnnxExportError where
    the error exceeds TOLERANCE."""
    import onnx
    import onnxruntime

    try:
        onnx.checker.check_model(str(path), full_check=True)
        options = onnxruntime.SessionOptions()
        # a check, not a server: no arena or planned buffers kept at their peak size (a
        # full-size VAE decoder's frames are gigabytes)
        options.enable_cpu_mem_arena = False
        options.enable_mem_pattern = False
        session = onnxruntime.InferenceSession(str(path), options,
                                               providers=["CPUExecutionProvider"])
    except Exception as e:
        raise OnnxExportError(f"--export-onnx: the {graph.name} graph does not load in onnxruntime "
                              f"({one_line(e)})") from None
    worst, first = 0.0, ()
    torch_in: dict = {}
    ort_in: dict = {}
    for i, call in enumerate(graph.calls):
        torch_in |= call
        ort_in |= {k: v.numpy() for k, v in call.items()}
        want = outputs_of(graph.module, torch_in, graph.inputs)
        got = session.run(list(graph.outputs), {n: ort_in[n] for n in graph.inputs})
        first = first or want
        for name, t, o in zip(graph.outputs, want, got):
            t = t.numpy()
            if o.shape != t.shape:
                raise OnnxExportError(f"--export-onnx: the {graph.name} graph's {name} is "
                                      f"{list(o.shape)} in onnxruntime, {list(t.shape)} in "
                                      "torch")
            err = float(np.abs(o.astype(np.float64) - t).max(initial=0.0)) / max(
                1.0, float(np.abs(t).max(initial=0.0)))
            if not err <= TOLERANCE:
                raise OnnxExportError(
                    f"--export-onnx: the {graph.name} graph's {name} differs between "
                    f"onnxruntime and torch by {err:.1e} at call {i + 1} of "
                    f"{len(graph.calls)} (the bound is {TOLERANCE:.0e}): the export is wrong")
            worst = max(worst, err)
            if name in graph.carry:
                torch_in[graph.carry[name]] = torch.from_numpy(t)
                ort_in[graph.carry[name]] = o
    return worst, first


def tensors_of(names, tensors) -> list[dict]:
    return [{"name": n, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
            for n, t in zip(names, tensors)]


def export_onnx(cfg, side_state: dict, out: Path, log=print) -> dict:
    """Write the family's graphs of the side networks in `side_state` to `out` (the engine's
    onnx/ directory, in the staging directory) and check each; the manifest's "onnx" entry."""
    require_onnx()
    fam, spec = family_of(cfg), cfg.model
    side = fam.load_side(cfg, side_state, "cpu")
    out.mkdir()
    graphs = {}
    for graph in fam.onnx_graphs(spec, side):
        path = out / f"{graph.name}.onnx"
        export_graph(graph, path, {"charengine.model": spec.name,
                                   "charengine.family": cfg.family,
                                   "charengine.graph": graph.name})
        err, outputs = check_graph(graph, path)
        graphs[graph.name] = {
            "file": f"{ONNX}/{path.name}",
            "call": graph.doc,
            "inputs": tensors_of(graph.inputs, (graph.calls[0][n] for n in graph.inputs)),
            "outputs": tensors_of(graph.outputs, outputs),
            "carry": dict(graph.carry),
            "checked_calls": len(graph.calls),
            "max_error": err,
        }
        log(f"onnx: {ONNX}/{path.name} ({path.stat().st_size / 2**20:.1f} MiB), onnxruntime "
            f"matches torch to {err:.1e} over {len(graph.calls)} calls")
    return {"opset": OPSET, "exporter": f"torch.onnx.export(dynamo=True), torch "
            f"{torch.__version__}", "onnx": version("onnx"),
            "onnxruntime": version("onnxruntime"), "dtype": "float32", "dynamic_axes": False,
            "tolerance": TOLERANCE, "graphs": graphs}
