"""Write what compilation did as a navigable folder: index.md, each graph before and after each
pass, the kernel chosen for every linear layer and why, graph-break and recompile reports."""

import re
from collections import Counter
from pathlib import Path

# The ops torch's functional collectives trace to (a tensor-parallel model's all-reduces and gathers),
# and qrt's all-reduce through shared memory, which replaces theirs among CPU ranks of one host.
_COLLECTIVE = re.compile(r"_c10d_functional\.(\w+)|qrt_cpu\.(shm_all_reduce)\b")


def write_dump(out: Path, logs, explain: dict, recompile_check: str, header: list[str]) -> Path:
    """logs: CompileLog per compiled function; explain: role -> torch._dynamo.explain output."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    index = ["# qrt compile dump", "", *header, ""]
    index += ["## Graphs", "", "| function | graph | pass | nodes changed | before | after |", "|---|---|---|---|---|---|"]
    for log in logs:
        for number, report in enumerate(log.graphs):
            for step, record in enumerate(report.passes):
                stem = f"{log.label}.graph{number}.{step:02d}.{record.name}"
                (out / f"{stem}.before.py").write_text(record.code_before)
                (out / f"{stem}.after.py").write_text(record.code_after)
                index.append(
                    f"| {log.label} | {number} | {record.name} (uuid {record.uuid}) | {record.changed} "
                    f"| [{stem}.before.py]({stem}.before.py) | [{stem}.after.py]({stem}.after.py) |"
                )
    index += ["", "## Collectives", "", *_collectives(logs), ""]
    index += ["## Kernel per linear layer", "", "[kernels.md](kernels.md)", ""]
    (out / "kernels.md").write_text(_kernel_table(logs))
    index += ["## Graph breaks", ""]
    breaks = []
    for role, result in explain.items():
        index.append(f"- {role}: {result.graph_count} graph(s), {result.graph_break_count} break(s)")
        for reason in result.break_reasons:
            breaks.append(f"{role}: {reason.reason}\n" + "".join(str(frame) for frame in reason.user_stack))
    (out / "graph_breaks.txt").write_text("\n\n".join(breaks) or "no graph breaks\n")
    index += ["", "Details: [graph_breaks.txt](graph_breaks.txt)", "", "## Recompiles", "", recompile_check, ""]
    (out / "index.md").write_text("\n".join(index))
    return out / "index.md"


def _collectives(logs) -> list[str]:
    """Per graph, the collective ops its final code calls (none in a model on one rank). A layer
    body compiled once (a nested region) counts once however many layers call it."""
    lines = []
    for log in logs:
        for number, report in enumerate(log.graphs):
            if not report.passes:
                continue
            found = Counter(functional or shm for functional, shm in _COLLECTIVE.findall(report.passes[-1].code_after))
            ops = ", ".join(f"{op} x{count}" for op, count in sorted(found.items())) or "none"
            lines.append(f"- {log.label} graph {number}: {ops}")
    return lines or ["- no graphs"]


def _kernel_table(logs) -> str:
    rows = ["# Kernel chosen for each quantized linear", "",
            "| function | node | logical op | kernel | weight | device | why |", "|---|---|---|---|---|---|---|"]
    for log in logs:
        for report in log.graphs:
            for choice in report.kernel_choices:
                weight = f"{list(choice.weight_shape)} {choice.weight_dtype}"
                rows.append(f"| {log.label} | `{choice.node}` | {choice.logical_op} | {choice.kernel} "
                            f"| {weight} | {choice.device} | {choice.reason} |")
    if len(rows) == 4:
        rows.append("| | | | (no quantized linear layers: nothing to swap) | | | |")
    rows += ["", "# Kernel chosen for each decode-attention call", "",
             "| function | node | kernel | K cache | device | why |", "|---|---|---|---|---|---|"]
    for log in logs:
        for report in log.graphs:
            for choice in report.attention_choices:
                cache = f"{list(choice.weight_shape)} {choice.weight_dtype}"
                rows.append(f"| {log.label} | `{choice.node}` | {choice.kernel} | {cache} | {choice.device} "
                            f"| {choice.reason} |")
    return "\n".join(rows) + "\n"
