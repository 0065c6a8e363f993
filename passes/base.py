"""What every qrt graph pass is: a named, versioned transformation of an FX graph."""

import hashlib
import inspect

import torch.fx


class GraphPass:
    """Subclasses set `name` and implement `run(gm, report) -> int` (nodes changed).

    `uuid` hashes the pass's source, so a cache keyed on it is invalidated when the pass changes.
    """

    name = "unnamed"

    @property
    def uuid(self) -> str:
        source = inspect.getsource(type(self))
        return hashlib.sha256(source.encode()).hexdigest()[:16]

    def run(self, gm: torch.fx.GraphModule, report) -> int:
        raise NotImplementedError


def count_ops(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Number of call_function nodes per target name, e.g. {'qrt.fp8_linear': 14, ...}."""
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function":
            name = target_name(node.target)
            counts[name] = counts.get(name, 0) + 1
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
