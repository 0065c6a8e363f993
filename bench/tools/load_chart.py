"""serve_load's chart: latency against load. One line per engine (or server variant) and
figure, the number of concurrent clients along x: time to first token (p50 solid, p99 dashed) on
the left, output tokens/s on the right. Needs matplotlib (`pip install -e ".[bench]"`)."""

from pathlib import Path


def write_load_chart(levels: list[dict], path: Path, title: str) -> None:
    """levels: serve_load's report rows ({"engine", "clients", "ttft_p50_s", "ttft_p99_s",
    "output_tok_s", ...}), any number of engines, each with its own levels."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    engines = list(dict.fromkeys(row["engine"] for row in levels))  # in the report's order
    fig, (latency, throughput) = plt.subplots(1, 2, figsize=(10, 4.2))
    for i, engine in enumerate(engines):
        rows = sorted((row for row in levels if row["engine"] == engine), key=lambda row: row["clients"])
        clients = [row["clients"] for row in rows]
        color = f"C{i}"
        for key, style, what in (("ttft_p50_s", "-", "p50"), ("ttft_p99_s", "--", "p99")):
            points = [(c, row[key] * 1000) for c, row in zip(clients, rows) if row[key] is not None]
            if points:
                latency.plot(*zip(*points), style, marker="o", color=color, label=f"{engine} TTFT {what}")
        throughput.plot(clients, [row["output_tok_s"] for row in rows], "-", marker="o", color=color, label=engine)
    for ax in (latency, throughput):
        ax.set_xlabel("concurrent clients")
        ax.set_xticks(sorted({row["clients"] for row in levels}))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    latency.set_ylabel("time to first token, ms")
    latency.set_yscale("log")  # one client's tens of ms and a queue's seconds on one axis
    throughput.set_ylabel("output tokens/s, all clients")
    throughput.set_ylim(bottom=0)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
