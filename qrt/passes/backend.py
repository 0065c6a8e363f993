"""qrt's torch.compile backend: Dynamo graph -> qrt passes -> Inductor."""

import contextlib
import hashlib
import inspect
import sys
import unittest.mock
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import sympy

import torch
from torch._inductor import config as inductor_config
from torch._inductor import lowering
from torch._inductor import standalone_compile
from torch._inductor.compile_fx import compile_fx

from .manager import GraphReport, passes_for, run_passes


@dataclass
class CompiledGraph:
    """What the backend made of one Dynamo graph, for callers that call it without Dynamo
    (qrt/runtime/direct_graph.py): the function, the inputs Dynamo compiled it for (the weights,
    caches and that call's own tensors and sizes), each input's traced value (fake tensors with
    their symbolic sizes, or the size symbols themselves), the range of every size symbol (None
    where a guard constrains the sizes in another way than a range), the symbols guarded equal,
    and the serialized function where it was compiled to be saved (`QrtBackend(aot=True)`)."""

    fn: Callable
    inputs: tuple
    traced: list
    outputs: int  # how many tensors the graph returns, in the traced function's order
    symbol_ranges: dict[str, tuple[int, int]] | None
    equal_symbols: tuple[tuple[str, str], ...]
    artifact: bytes | None = None


@dataclass
class CompileLog:
    """One per compiled function: a report per graph Dynamo hands over. A function compiled
    with zero graph breaks and no recompiles has exactly one."""

    label: str
    graphs: list[GraphReport] = field(default_factory=list)


class QrtBackend:
    """A torch.compile backend; `log.graphs` grows by one each time Dynamo (re)compiles."""

    def __init__(self, label: str, inductor: bool = True, freeze: bool = False, autotune: bool = False,
                 device: str | None = None, aot: bool = False):
        self.log = CompileLog(label)
        # The newest compiled graph, for callers that call it without Dynamo.
        self.last_compiled: CompiledGraph | None = None
        self.inductor = inductor
        # Compile through Inductor's standalone_compile(aot=True), whose result serializes into
        # one self-contained artifact: qrt's compile cache stores it, and a later start calls it
        # without tracing the model again (runtime/compiled.py).
        self.aot = aot
        self.device = device  # whose pass list runs; None: the device of the graph's inputs
        # Freezing turns weights into constants, which lets Inductor prepack them for oneDNN on
        # the CPU: decode of the default model went from 1.56 s to 31 ms per token with it.
        self.freeze = freeze
        # Dynamo's guards check every graph input's sizes and strides before the graph runs, so the
        # wrapper's own size asserts only re-check them; there were about 28 per decoder layer on
        # each decode step, every one a call from the Python wrapper (docs/cpu-kernels.md).
        self.config_patches = {"size_asserts": False,
                               # Round a fused kernel's intermediates to bf16/fp16 where eager rounds
                               # them, so a compiled graph computes what the reference ops compute
                               # (docs/quality.md: without it one prompt position scored 2 nats apart).
                               "emulate_precision_casts": True}
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
        if all(report.loaded for report in self.log.graphs):
            # The graphs on record came from the compile cache without Dynamo; this trace of the
            # same function is their first through Dynamo, not a recompile.
            self.log.graphs.clear()
        report = GraphReport(f"{self.log.label}#{len(self.log.graphs)}")
        self.log.graphs.append(report)
        traced = [node.meta.get("example_value") for node in gm.graph.find_nodes(op="placeholder")]
        returned = gm.graph.output_node().args[0]
        outputs = len(returned) if isinstance(returned, (tuple, list)) else 1
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
            compiled, artifact = self._compile_saveable(gm, example_inputs) if self.aot else (None, None)
            if compiled is None:
                compiled = compile_fx(gm, example_inputs)
        self.last_compiled = CompiledGraph(compiled, tuple(example_inputs), traced, outputs, *symbol_ranges(), artifact)
        return compiled

    def _compile_saveable(self, gm: torch.fx.GraphModule, example_inputs) -> tuple[Callable | None, bytes | None]:
        """The graph compiled into a serializable artifact, and the artifact's bytes; (None, None)
        where that fails (the graph is then compiled the ordinary way, and a later start traces
        it again instead of loading it), with a line saying why."""
        try:
            compiled = standalone_compile(gm, list(example_inputs), dynamic_shapes="from_graph", aot=True)
            return compiled, compiled.serialize()
        except Exception as err:  # noqa: BLE001  (a graph that cannot be saved still runs)
            print(f"qrt: the {self.log.label} graph cannot be saved for the next start ({type(err).__name__}: "
                  f"{err}); it is compiled without that", file=sys.stderr, flush=True)
            return None, None


def load_artifact(data: bytes) -> Callable:
    """A graph that `QrtBackend(aot=True)` compiled, from its serialized artifact."""
    from torch._inductor.standalone_compile import AOTCompiledArtifact

    return AOTCompiledArtifact.deserialize(data)


def aot_supported() -> bool:
    """Whether this torch's standalone_compile makes serializable artifacts (torch >= 2.10)."""
    return "aot" in inspect.signature(standalone_compile).parameters


def symbol_ranges() -> tuple[dict[str, tuple[int, int]] | None, tuple[tuple[str, str], ...]]:
    """The range of each size symbol of the graph being compiled, from the shape environment of
    the ambient trace, and the pairs of symbols its guards hold equal (Dynamo traces the graph
    with one of each pair). Ranges None when a guard is neither a range of one symbol nor such an
    equality (a sum, a divisibility): a caller checking only ranges could not keep that."""
    context = torch._guards.TracingContext.try_get()
    shape_env = context.fake_mode.shape_env if context is not None and context.fake_mode is not None else None
    if shape_env is None:
        return {}, ()
    ranges = {}
    for symbol, bounds in shape_env.var_to_range.items():
        low, high = _bound(bounds.lower), _bound(bounds.upper)
        if low is not None and high is not None:
            ranges[symbol] = (low, high)
    equal = []
    for guard in shape_env.guards:
        expr = guard.expr
        if isinstance(expr, sympy.Equality) and all(isinstance(side, sympy.Symbol) for side in expr.args):
            equal.append(tuple(str(side) for side in expr.args))
        elif not _implied_by_ranges(expr, ranges):
            return None, ()
    return {str(symbol): bounds for symbol, bounds in ranges.items()}, tuple(equal)


def _bound(value) -> int | None:
    """A symbol's bound as an int; None for an infinite one (sympy's or torch's) or a float's."""
    if not getattr(value, "is_Integer", False):
        return None
    return int(value)


def _implied_by_ranges(expr, ranges: dict) -> bool:
    """Whether a shape guard bounds one symbol (2 <= s, s <= 2047), or excludes a value its range
    excludes anyway (s != 1 for a range from 2)."""
    if not isinstance(expr, sympy.core.relational.Relational) or len(expr.free_symbols) != 1:
        return False
    (symbol,) = expr.free_symbols
    sides = expr.args
    if not (any(side == symbol for side in sides) and any(side.is_number for side in sides)):
        return False
    if isinstance(expr, (sympy.LessThan, sympy.StrictLessThan, sympy.GreaterThan, sympy.StrictGreaterThan)):
        return True
    if isinstance(expr, sympy.Unequality) and symbol in ranges:
        value = next(side for side in sides if side.is_number)
        low, high = ranges[symbol]
        return not low <= value <= high
    return False


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
