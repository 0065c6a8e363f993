"""qrt's torch.compile backend: Dynamo graph -> qrt passes -> Inductor."""

import contextlib
import hashlib
import unittest.mock
import warnings
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import torch
from torch._inductor import config as inductor_config
from torch._inductor import lowering
from torch._inductor.compile_fx import compile_fx

from .manager import GraphReport, passes_for, run_passes


@dataclass
class CompileLog:
    """One per compiled function: a report per graph Dynamo hands over. A function compiled
    with zero graph breaks and no recompiles has exactly one."""

    label: str
    graphs: list[GraphReport] = field(default_factory=list)


class QrtBackend:
    """A torch.compile backend; `log.graphs` grows by one each time Dynamo (re)compiles."""

    def __init__(self, label: str, inductor: bool = True, freeze: bool = False, autotune: bool = False,
                 device: str | None = None):
        self.log = CompileLog(label)
        # The newest compiled graph and the inputs Dynamo compiled it for (weights, caches, and
        # that call's own tensors and sizes), for callers that call it without Dynamo
        # (qrt/runtime/direct_graph.py).
        self.last_compiled: tuple | None = None
        self.inductor = inductor
        self.device = device  # whose pass list runs; None: the device of the graph's inputs
        # Freezing turns weights into constants, which lets Inductor prepack them for oneDNN on
        # the CPU: decode of the default model went from 1.56 s to 31 ms per token with it.
        self.freeze = freeze
        # Dynamo's guards check every graph input's sizes and strides before the graph runs, so the
        # wrapper's own size asserts only re-check them; there were about 28 per decoder layer on
        # each decode step, every one a call from the Python wrapper (docs/cpu-kernels.md).
        self.config_patches = {"size_asserts": False}
        if freeze:
            self.config_patches["freezing"] = True
        if autotune:
            # Inductor times its C++ GEMM templates against ATen for each matmul shape and keeps
            # the fastest; on the CPU's one-token decode graph that measured +30% (bf16) and +35%
            # (int4, whose bf16 lm_head dominates) for about 35 s more compiling.
            self.config_patches |= {"max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
                                    # the choice tables it prints per matmul are for Inductor's developers
                                    "autotune_num_choices_displayed": 0,
                                    "max_autotune_report_choices_stats": False}

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        report = GraphReport(f"{self.log.label}#{len(self.log.graphs)}")
        self.log.graphs.append(report)
        device = self.device or next((t.device.type for t in example_inputs if isinstance(t, torch.Tensor)), "cpu")
        gm = run_passes(gm, report, passes_for(device), example_inputs=example_inputs)
        if not self.inductor:
            return gm.forward
        # Patched globally for the duration of the compile, not passed as compile_fx's
        # config_patches: the oneDNN weight-prepacking passes read the global config, and with
        # config_patches alone decode ran 25% slower (no prepacked linears).
        with inductor_config.patch(self.config_patches), torch.compiler.config.patch(cache_key_tag=source_tag()), \
                _int4_matmul_as_aten_call(not self.freeze), warnings.catch_warnings():
            # Inductor's autotuner calls the deprecated Tensor.storage() once per GEMM it times;
            # the warning is about torch's own code, and a user can do nothing about it.
            warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning)
            compiled = compile_fx(gm, example_inputs)
        self.last_compiled = (compiled, tuple(example_inputs))
        return compiled


def _int4_matmul_as_aten_call(enabled: bool):
    """Inductor lowers ATen's int4 CPU matmul with its group size as a tensor constant, which
    only pays off when frozen weights let it autotune a C++ template. In a graph with nested
    compile regions (torch 2.13) the kernel is then handed another tensor in that constant's place
    ("group size must be a scalar"). Without frozen weights there is no template to gain, so the
    call stays a plain ATen call from the wrapper: a fallback, for this compile only."""
    if not enabled:
        return contextlib.nullcontext()
    op = torch.ops.aten._weight_int4pack_mm_for_cpu.default
    return unittest.mock.patch.dict(lowering.lowerings, {op: lowering.fallback_handler(op, add_to_fallback_set=False)})


@cache
def source_tag() -> str:
    """A hash of qrt's kernel and pass sources, added to Inductor's cache keys: those keys do not
    cover the Python body of a CompositeImplicitAutograd kernel, so without it an edited CPU
    kernel could be served from a stale cache entry."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]
    for folder in ("kernels", "passes"):
        for path in sorted((root / folder).glob("*.py")):
            digest.update(path.read_bytes())
    return "qrt-" + digest.hexdigest()[:16]
