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
    """'qrt.fp8_linear' for torch.ops.qrt.fp8_linear (packet or overload); else the callable's name."""
    schema_name = getattr(target, "_qualified_op_name", None) or getattr(target, "__name__", None)
    if hasattr(target, "_schema"):
        schema_name = target._schema.name
    if isinstance(schema_name, str) and "::" in schema_name:
        return schema_name.replace("::", ".")
    module = getattr(target, "__module__", "") or ""
    return f"{module}.{schema_name}" if module and schema_name else str(target)
