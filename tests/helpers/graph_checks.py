"""Checks on what torch.compile made of a model, shared by the tests that compile one.

A compiled model has one backend per role (prefill, decode, forward), and each backend's log gets
a report for every graph Dynamo hands it: one graph per role means no graph breaks and no
recompiles. Each report records what the swap pass did (ops counted before and after it) and
which kernel it chose for each linear.
"""

import contextlib

import torch

from qrt.passes.base import count_ops

ROLES = ("prefill", "decode", "forward")


def assert_one_graph_per_role(model, forward: bool = True) -> None:
    """Prefill and decode compiled one graph each, and forward one if it has run (else none)."""
    assert model.compile_report() == {"prefill": 1, "decode": 1, "forward": int(forward)}


@contextlib.contextmanager
def no_recompiles(model):
    """A context in which anything that would make Dynamo compile again raises instead. `model`
    decodes through Dynamo in it (`guarded`), so that its guards see every decode step, which
    otherwise calls the compiled graph directly."""
    with model.guarded(), torch.compiler.set_stance("fail_on_recompile"):
        yield


def decode_without_recompiles(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """model.generate's greedy tokens, failing if prefill or decode would be recompiled: prompt
    lengths are dynamic in the prefill graph, and every decode step reuses one graph."""
    with no_recompiles(model):
        return model.generate(prompt, max_new_tokens=max_new_tokens, stop_at_eos=False)


def assert_no_graph_breaks(model, role: str) -> None:
    """Dynamo's own account of the model's prefill (6 tokens) or decode (1 token) step: one graph,
    no breaks. Dynamo is reset by it, which discards the model's compiled graphs."""
    with torch.no_grad():
        result = torch._dynamo.explain(model.model)(*model.graph_inputs(role))
    assert result.graph_count == 1 and result.graph_break_count == 0, result.break_reasons


def swap_record(log, name: str = "swap_quantized_linear"):
    """(graph report, the record of pass `name`) of a compile log that holds exactly one graph.
    CPU graphs get the three swap passes: linears, experts, then decode attention."""
    (graph,) = log.graphs
    assert [p.name for p in graph.passes] == ["swap_quantized_linear", "swap_fused_experts", "swap_decode_attention"]
    return graph, next(p for p in graph.passes if p.name == name)


def assert_every_linear_runs(model, kernel: str, count: int, swapped_from: str | None = None,
                             roles: tuple[str, ...] = ROLES, lm_head: str | None = None) -> None:
    """Each role's single graph runs `count` linears, all through `kernel`, as the swap pass chose.

    swapped_from: the logical op the layers call, which the swap pass replaced with `kernel`, none
    of it left; None where the loader already put `kernel` in the layers and there was nothing to
    replace. lm_head: the kernel of a quantized lm_head, called as it is (the graph's own order of choices
    lists it first: the layers' bodies are nested regions)."""
    for role in roles:
        graph, swap = swap_record(model.backends[role].log)
        assert swap.ops_before.get(swapped_from or kernel, 0) == count, role
        assert swap.ops_after.get(kernel, 0) == count, role
        if swapped_from is not None:
            assert swap.ops_after.get(swapped_from, 0) == 0, role
        assert swap.changed == (0 if swapped_from is None else count), role
        expected = [kernel] * count + ([lm_head] if lm_head else [])
        assert sorted(c.kernel for c in graph.kernel_choices) == sorted(expected), role


def qrt_op_counts(gm: torch.fx.GraphModule) -> dict:
    """How many times each qrt:: op is called in gm, nested regions included (qrt.passes' count)."""
    return {name: count for name, count in count_ops(gm).items() if name.startswith("qrt.")}
