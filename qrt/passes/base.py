"""What every qrt graph pass is: a named, versioned transformation of an FX graph."""

import hashlib
import inspect

import torch.fx


class GraphPass:
    """Subclasses set `name` and implement `run(gm, report, calls, values) -> int` (nodes changed).

    `uuid` hashes the pass's source, so that a dump names the version of each pass it ran. Compiled
    graphs are not keyed on it: Inductor's caches key on backend.source_tag(), qrt's compile cache
    on all of qrt's sources (runtime/compile_cache.py), both of which cover the passes.
    """

    name = "unnamed"

    @property
    def uuid(self) -> str:
        source = inspect.getsource(type(self))
        return hashlib.sha256(source.encode()).hexdigest()[:16]

    def run(self, gm: torch.fx.GraphModule, report, calls: int = 1, values: dict | None = None) -> int:
        """Transform one graph; `calls`: how many times one run of the compiled function runs it
        (a nested compile region's body runs once per decoder layer); `values`: the real tensors
        its input nodes take (see `input_values`), when the backend was given them."""
        raise NotImplementedError


def graph_modules(gm: torch.fx.GraphModule) -> list[tuple[str, torch.fx.GraphModule, int]]:
    """(name, graph module, calls per run) for `gm` and each subgraph it invokes: the bodies of
    nested compile regions, which Dynamo stores once however many layers call them."""
    found = [("", gm, 1)]
    for _, graph, calls in found:  # grows while it is walked: subgraphs may invoke subgraphs
        for node in graph.graph.nodes:
            if node.op == "call_function" and node.target is torch.ops.higher_order.invoke_subgraph:
                name = node.args[0].target
                entry = next((i for i, (seen, _, _) in enumerate(found) if seen == name), None)
                if entry is None:
                    found.append((name, getattr(graph, name), calls))
                else:
                    found[entry] = (name, found[entry][1], found[entry][2] + calls)
    return found


def _placeholders(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [node for node in gm.graph.nodes if node.op == "placeholder"]


def input_values(gm: torch.fx.GraphModule, example_inputs) -> dict[torch.fx.Node, list]:
    """For the input nodes of `gm` and of every subgraph it invokes, the real values they take in
    one run: the backend's example inputs (Dynamo hands it the model's real parameters), tensors
    held as graph attributes, and for a nested region's body, one value per layer calling it."""
    values: dict[torch.fx.Node, list] = {}
    for node, value in zip(_placeholders(gm), example_inputs):
        values[node] = [value]
    for _, graph, _ in graph_modules(gm):  # outer graphs before the bodies they invoke
        for node in graph.graph.nodes:
            if node.op == "get_attr":
                attribute = getattr(graph, node.target, None)
                if isinstance(attribute, torch.Tensor):
                    values[node] = [attribute]
            elif node.op == "call_function" and node.target is torch.ops.higher_order.invoke_subgraph:
                body = getattr(graph, node.args[0].target)
                for placeholder, operand in zip(_placeholders(body), node.args[2:]):
                    values.setdefault(placeholder, []).extend(values.get(operand, []))
    return values


def graph_code(gm: torch.fx.GraphModule) -> str:
    """The Python code of `gm` followed by that of each subgraph it invokes."""
    parts = [gm.code]
    for name, sub, calls in graph_modules(gm)[1:]:
        parts.append(f"\n# ---- subgraph {name}: called {calls}x per run ----\n{sub.code}")
    return "".join(parts)


def count_ops(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Number of call_function nodes per target name, e.g. {'qrt.fp8_linear': 14, ...}, counting
    a subgraph's ops once per call, as a graph without nested regions would hold them."""
    counts: dict[str, int] = {}
    for _, graph, calls in graph_modules(gm):
        for node in graph.graph.nodes:
            if node.op == "call_function" and node.target is not torch.ops.higher_order.invoke_subgraph:
                name = target_name(node.target)
                counts[name] = counts.get(name, 0) + calls
    return counts


def target_name(target) -> str:
    """'qrt.fp8_linear' for torch.ops.qrt.fp8_linear, whether the graph holds the op packet (as
    Dynamo graphs do) or an overload (as traced aten graphs do); 'module.name' for a function."""
    if hasattr(target, "_schema"):  # OpOverload
        return target._schema.name.replace("::", ".")
    if hasattr(target, "_qualified_op_name"):  # OpOverloadPacket
        return target._qualified_op_name.replace("::", ".")
    module = getattr(target, "__module__", None)
    name = getattr(target, "__name__", None)
    return f"{module}.{name}" if module and name else str(target)
