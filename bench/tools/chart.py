"""The suite's chart: decode tokens/s of each engine and format, one bar per batch size, the median
with a whisker from the slowest to the fastest run. Needs matplotlib (`pip install -e ".[bench]"`)."""

from pathlib import Path


def write_chart(rows: list[dict], batches: list[int], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    labels = [row["label"] for row in rows]
    width = 0.8 / len(batches)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(rows) + 2), 4.5))
    for i, batch in enumerate(batches):
        figures = [row["decode_tok_s"][str(batch)] for row in rows]
        medians = [f["median"] if f else 0.0 for f in figures]  # 0: not measured (shown as no bar)
        whiskers = [[f["median"] - f["min"] if f else 0.0 for f in figures],
                    [f["max"] - f["median"] if f else 0.0 for f in figures]]
        positions = [x + (i - (len(batches) - 1) / 2) * width for x in range(len(rows))]
        bars = ax.bar(positions, medians, width, yerr=whiskers, capsize=3, label=f"batch {batch}")
        ax.bar_label(bars, labels=[f"{m:.0f}" if m else "" for m in medians], fontsize=7, padding=2)
    ax.set_xticks(range(len(rows)), labels, rotation=30, ha="right")
    ax.set_ylabel("decode tokens/s (median, whisker: min–max)")
    ax.set_title(title, fontsize=10)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
