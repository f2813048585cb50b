"""The benchmarks' charts: batchd beside each peer, drawn from what a bench printed.

A bench run as a script records its output (``with recorded("packing"): main()``): what it
printed goes to the terminal as before and, at the end, to ``bench/results/<bench>.md``, and
the bench's chart is drawn from the tables in it into ``docs/img/bench/<bench>.png``, which
the Benchmarks page shows. A smoke run (``--quick``) records nothing, so it never replaces
a real run's numbers. Run alone, this module redraws charts from the saved results::

    .venv/bin/python bench/plots.py              # every bench with saved results
    .venv/bin/python bench/plots.py packing      # one

Each chart reads the tables by their headings and columns as the bench prints them, so a
bench whose table changes shape changes its plotter here. Needs matplotlib
(``requirements/bench.txt``); without it a bench still saves its results and says so.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
"""``<bench>.md``: a bench's output, as it printed it, with the date of the run on top."""
IMAGES = BENCH.parent / "docs" / "img" / "bench"
"""``<bench>.png``: the charts the Benchmarks page shows."""

BATCHD = "#1f5fa8"
"""batchd's bars: one blue, so that the reader finds batchd in every chart at a glance."""
BATCHD_LIGHT = "#7fa7d6"
PEER = "#d9822b"
PEER_LIGHT = "#f0b97a"
OTHER = "#9a9a9a"
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


@dataclass(frozen=True)
class Table:
    """One markdown table of a bench's output and the heading above it."""

    heading: str
    columns: list[str]
    rows: list[list[str]]

    def col(self, prefix: str) -> int:
        """The index of the first column whose name starts with ``prefix``."""
        for i, name in enumerate(self.columns):
            if name.lower().startswith(prefix.lower()):
                return i
        raise KeyError(f"no column {prefix!r} in {self.columns} (table {self.heading!r})")

    def labels(self) -> list[str]:
        return [row[0].strip("*` ") for row in self.rows]

    def values(self, prefix: str) -> list[float]:
        i = self.col(prefix)
        return [number(row[i]) for row in self.rows]


def number(cell: str) -> float:
    """The first number in a cell: ``"1,105 (1,077-1,120)"`` is 1105.0; NaN if none."""
    match = _NUMBER.search(cell.replace("**", ""))
    return float(match[0].replace(",", "")) if match else float("nan")


def tables(markdown: str) -> list[Table]:
    """Every table of ``markdown``, each with the last ``#`` heading before it."""
    found: list[Table] = []
    heading, block = "", []
    for line in [*markdown.splitlines(), ""]:
        if line.startswith("|"):
            block.append([cell.strip() for cell in line.strip().strip("|").split("|")])
            continue
        if len(block) > 2:
            found.append(Table(heading, block[0], block[2:]))
        block = []
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
    return found


def is_batchd(label: str) -> bool:
    return label.lower().startswith("batchd")


def _bars(ax: Any, labels: list[str], values: list[float], colours: list[str]) -> None:
    """Horizontal bars, first label on top, each with its value at its end."""
    y = list(range(len(labels)))[::-1]
    ax.barh(y, values, color=colours)
    ax.set_yticks(y, labels)
    for yi, value in zip(y, values, strict=True):
        if value == value:  # not NaN
            ax.annotate(
                f" {value:,.0f}" if value >= 100 else f" {value:.3g}",
                (value, yi),
                va="center",
                fontsize=8,
            )
    ax.grid(axis="x", alpha=0.3)
    ax.margins(x=0.15)


def _grouped(
    ax: Any, groups: list[str], series: dict[str, list[float]], colours: dict[str, str]
) -> None:
    """Vertical bars: one group per ``groups`` entry, one bar per series within it."""
    width = 0.8 / max(1, len(series))
    for k, (name, values) in enumerate(series.items()):
        xs = [g + (k - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, values, width, label=name, color=colours.get(name, OTHER))
    ax.set_xticks(range(len(groups)), groups)
    ax.grid(axis="y", alpha=0.3)


def _colour(label: str) -> str:
    return BATCHD if is_batchd(label) else PEER


def _figure(rows: int, cols: int, width: float, height: float) -> tuple[Any, Any]:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, cols, figsize=(width, height), squeeze=False)
    return fig, axes


# -- one plotter per bench ------------------------------------------------------------------


def plot_loader_vs_dataloader(found: list[Table]) -> Any:
    """samples/s of every DataLoader setting and batchd, one panel per workload."""
    from matplotlib.ticker import MaxNLocator

    panels = [t for t in found if t.columns[0] == "config"]
    rows = (len(panels) + 1) // 2
    fig, axes = _figure(rows, 2, 14, 3.0 * rows)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, table in zip(axes.flat, panels, strict=False):
        labels = table.labels()
        _bars(ax, labels, table.values("samples/s"), [_colour(x) for x in labels])
        ax.set_title(textwrap.fill(table.heading.split(":")[0], 60), fontsize=10)
        ax.set_xlabel("samples/s, median (higher is better)")
        ax.xaxis.set_major_formatter("{x:,.0f}")
        ax.xaxis.set_major_locator(MaxNLocator(5))
    return fig


def plot_peers(found: list[Table]) -> Any:
    """samples/s of every peer and batchd on small records, log scale, one panel a workload."""
    panels = [t for t in found if t.columns[0] == "config"]
    fig, axes = _figure(1, len(panels), 5.2 * len(panels), 3.6)
    for ax, table in zip(axes[0], panels, strict=True):
        labels = table.labels()
        _bars(ax, labels, table.values("samples/s"), [_colour(x) for x in labels])
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter("{x:,.0f}")
        ax.set_title(textwrap.fill(table.heading, 50), fontsize=10)
        ax.set_xlabel("samples/s, median (log scale)")
    for ax in axes[0][1:]:
        ax.set_yticklabels([])
    return fig


def plot_image_floor(found: list[Table]) -> Any:
    """CPU ms per image of each step of both recipes, and both loaders' samples/s."""
    steps = next(t for t in found if t.columns[0] == "step")
    loaders = next(t for t in found if t.columns[0] == "loader")
    fig, axes = _figure(1, 2, 12, 3.8)
    labels = steps.labels()
    colours = [
        BATCHD if x.startswith("batchd") else PEER if "tutorial" in x else OTHER for x in labels
    ]
    _bars(axes[0][0], labels, steps.values("CPU ms"), colours)
    axes[0][0].set_title("CPU ms per image, each step (lower is better)", fontsize=10)
    names = loaders.labels()
    _bars(axes[0][1], names, loaders.values("samples/s"), [_colour(x) for x in names])
    axes[0][1].set_title("the loaders: samples/s (higher is better)", fontsize=10)
    return fig


def plot_decode_cache(found: list[Table]) -> Any:
    """samples/s of epochs 1, 2 and 3 per pipeline: epoch 1 decodes, 2 and 3 read the cache."""
    table = next(t for t in found if t.columns[0] == "pipeline")
    series = {f"epoch {e}": table.values(f"epoch {e}") for e in (1, 2, 3)}
    colours = {"epoch 1": OTHER, "epoch 2": BATCHD, "epoch 3": BATCHD_LIGHT}
    fig, axes = _figure(1, 1, 9, 3.8)
    ax = axes[0][0]
    _grouped(ax, table.labels(), series, colours)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter("{x:,.0f}")
    ax.set_ylabel("samples/s (log scale)")
    ax.set_title("epoch 1 fills the decode cache; epochs 2 and 3 read it", fontsize=10)
    ax.legend()
    return fig


def plot_scaling(found: list[Table]) -> Any:
    """samples/s against decode workers, with W x one worker, one panel per workload."""
    table = next(t for t in found if t.columns[:2] == ["workload", "workers"])
    names = list(dict.fromkeys(row[0] for row in table.rows))
    fig, axes = _figure(1, len(names), 5 * len(names), 3.6)
    for ax, name in zip(axes[0], names, strict=True):
        rows = [r for r in table.rows if r[0] == name]
        workers = [int(number(r[1])) for r in rows]
        ax.plot(workers, [number(r[2]) for r in rows], "o-", color=BATCHD, label="batchd")
        ideal = [number(r[table.col("W x")]) for r in rows]
        ax.plot(workers, ideal, "--", color=OTHER, label="W x one worker")
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("decode workers (W)")
        ax.set_ylabel("samples/s, median")
        ax.set_xticks(workers)
        ax.yaxis.set_major_formatter("{x:,.0f}")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    return fig


def _contender_bars(found: list[Table], title: str) -> Any:
    table = next(t for t in found if t.columns[0] == "config")
    fig, axes = _figure(1, 1, 8, 0.5 * len(table.rows) + 1.4)
    labels = table.labels()
    colours = [BATCHD if i else BATCHD_LIGHT for i in range(len(labels))]
    _bars(axes[0][0], labels, table.values("samples/s"), colours)
    axes[0][0].set_title(title, fontsize=10)
    axes[0][0].set_xlabel("samples/s, median")
    return fig


def plot_striping(found: list[Table]) -> Any:
    return _contender_bars(found, "one Loader striped over two 1-worker servers")


def plot_share(found: list[Table]) -> Any:
    """Aggregate samples/s and server CPU per sample of two jobs, separate and shared."""
    table = next(t for t in found if t.columns[0] == "config")
    fig, axes = _figure(1, 2, 10, 2.4)
    labels = table.labels()
    colours = [BATCHD_LIGHT if x == "separate" else BATCHD for x in labels]
    _bars(axes[0][0], labels, table.values("aggregate samples/s"), colours)
    axes[0][0].set_title("two jobs: aggregate samples/s (higher is better)", fontsize=10)
    _bars(axes[0][1], labels, table.values("server CPU"), colours)
    axes[0][1].set_title("server CPU ms per sample (lower is better)", fontsize=10)
    return fig


def plot_packing(found: list[Table]) -> Any:
    """Padding and real tokens/s of batchd's packers and Grain's, one row per seq_len."""
    panels = [t for t in found if t.columns[0] == "loader"]
    fig, axes = _figure(len(panels), 2, 12, 2.9 * len(panels))
    for row, table in zip(axes, panels, strict=True):
        labels = table.labels()
        colours = [_colour(x) for x in labels]
        padding = [max(v, 1e-3) for v in table.values("padding")]
        _bars(row[0], labels, padding, colours)
        row[0].set_xscale("log")
        row[0].xaxis.set_major_formatter("{x:g}")
        row[0].set_title(f"{table.heading}: padding %, log scale (lower is better)", fontsize=10)
        _bars(row[1], labels, table.values("real tokens/s"), colours)
        row[1].set_title(
            f"{table.heading}: real tokens/s, millions (higher is better)", fontsize=10
        )
        row[1].set_yticklabels([])
    return fig


def plot_autoscale(found: list[Table]) -> Any:
    """samples/s and workers alive per phase, the range beside the fixed counts."""
    table = next(t for t in found if t.columns[:2] == ["config", "phase"])
    configs = list(dict.fromkeys(r[0] for r in table.rows))
    fig, axes = _figure(1, 2, 11, 3.2)
    palette = [BATCHD, OTHER, BATCHD_LIGHT, PEER]
    for ax, column, title in (
        (axes[0][0], "samples/s", "samples/s"),
        (axes[0][1], "workers", "decode workers alive, mean"),
    ):
        i = table.col(column)
        series = {
            c: [number(r[i]) for p in ("light", "heavy") for r in table.rows if r[:2] == [c, p]]
            for c in configs
        }
        colours = dict(zip(configs, palette, strict=False))
        _grouped(ax, ["light phase", "heavy phase"], series, colours)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    return fig


def plot_object_store(found: list[Table]) -> Any:
    """samples/s cold and warm at each added latency, batchd's layouts beside the peers,
    local files as the line to reach."""
    table = next(t for t in found if t.columns[0] == "config")
    rate = dict(zip(table.labels(), table.values("samples/s"), strict=True))
    local = rate.get("batchd, local files", float("nan"))
    parsed = [re.fullmatch(r"(.+?),? (cold|warm), (\d+) ms", label) for label in rate]
    latencies = sorted({int(m[3]) for m in parsed if m})
    fig, axes = _figure(1, 2, 14, 4.2)
    for ax, state in zip(axes[0], ("cold", "warm"), strict=True):
        names = list(dict.fromkeys(m[1] for m in parsed if m and m[2] == state))
        series = {
            name: [
                rate.get(
                    f"{name}{',' if not is_batchd(name) else ''} {state}, {d} ms", float("nan")
                )
                for d in latencies
            ]
            for name in names
        }
        batchd = [n for n in names if is_batchd(n)]
        peers = [n for n in names if not is_batchd(n)]
        colours = dict(zip(batchd, [BATCHD, "#3d7cc9", BATCHD_LIGHT], strict=False))
        colours |= dict(zip(peers, [PEER, PEER_LIGHT, "#b35c00"], strict=False))
        _grouped(ax, [f"+{d} ms a request" for d in latencies], series, colours)
        ax.axhline(local, color="black", linestyle="--", linewidth=1, label="batchd, local files")
        ax.set_title(f"{state} epoch: samples/s (higher is better)", fontsize=10)
    axes[0][1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return fig


def plot_h2d_paths(found: list[Table]) -> Any:
    """GB/s of each host-to-device path from a shm slot, per batch size."""
    table = next(t for t in found if t.columns[:2] == ["batch MB", "path"])
    sizes = list(dict.fromkeys(r[0] for r in table.rows))
    paths = list(dict.fromkeys(r[1] for r in table.rows))
    series = {
        p: [number(next((r[2] for r in table.rows if r[:2] == [s, p]), "")) for s in sizes]
        for p in paths
    }
    colours = {"pageable": OTHER, "pinned-copy": BATCHD_LIGHT, "registered": BATCHD}
    fig, axes = _figure(1, 1, 7, 3.4)
    _grouped(axes[0][0], [f"{s} MB batch" for s in sizes], series, colours)
    axes[0][0].set_ylabel("GB/s (higher is better)")
    axes[0][0].legend()
    return fig


def plot_multimodal(found: list[Table]) -> Any:
    """Samples/s and trainer CPU per batch of batchd and the DataLoader, one row per section."""
    panels = [t for t in found if t.columns[0] == "config"]
    fig, axes = _figure(len(panels), 2, 12, 1.2 * len(panels) + 1.6)
    for row, table in zip(axes, panels, strict=True):
        labels = table.labels()
        colours = [_colour(label) for label in labels]
        _bars(row[0], labels, table.values("samples/s"), colours)
        row[0].set_title(
            textwrap.fill(table.heading, 60) + "\nsamples/s (higher is better)", fontsize=9
        )
        _bars(row[1], labels, table.values("train-process CPU"), colours)
        row[1].set_title("trainer CPU ms per batch (lower is better)", fontsize=9)
    return fig


PLOTTERS: dict[str, Callable[[list[Table]], Any]] = {
    "autoscale": plot_autoscale,
    "decode_cache": plot_decode_cache,
    "h2d_paths": plot_h2d_paths,
    "image_floor": plot_image_floor,
    "loader_vs_dataloader": plot_loader_vs_dataloader,
    "multimodal": plot_multimodal,
    "object_store": plot_object_store,
    "packing": plot_packing,
    "peers": plot_peers,
    "scaling": plot_scaling,
    "share": plot_share,
    "striping": plot_striping,
}
"""A bench's name (its script's stem) to the function that draws its chart."""


# -- saving and drawing ---------------------------------------------------------------------


def draw(bench: str) -> str:
    """Draw ``docs/img/bench/<bench>.png`` from ``bench/results/<bench>.md``; say what happened."""
    source = RESULTS / f"{bench}.md"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no chart: matplotlib is not installed (pip install -r requirements/bench.txt)"
    fig = PLOTTERS[bench](tables(source.read_text(encoding="utf-8")))
    fig.suptitle(f"bench/{bench}.py", fontsize=9, x=0.01, ha="left", color=OTHER)
    fig.tight_layout()
    IMAGES.mkdir(parents=True, exist_ok=True)
    target = IMAGES / f"{bench}.png"
    fig.savefig(target, dpi=100)
    plt.close(fig)
    return f"chart: {os.path.relpath(target, BENCH.parent)}"


class _Tee(io.TextIOBase):
    def __init__(self, out: TextIO) -> None:
        self.out, self.text = out, io.StringIO()

    def write(self, s: str) -> int:
        self.text.write(s)
        return self.out.write(s)

    def flush(self) -> None:
        self.out.flush()


@contextlib.contextmanager
def recorded(bench: str) -> Iterator[None]:
    """Run a bench's ``main()`` inside: its output is saved to ``bench/results/<bench>.md``
    and its chart drawn, unless it is a ``--quick`` smoke run or it failed."""
    if "--quick" in sys.argv:
        yield
        print("\nsmoke run (--quick): results not saved, chart not drawn")
        return
    tee = _Tee(sys.stdout)
    sys.stdout = tee  # type: ignore[assignment]
    try:
        yield
    finally:
        sys.stdout = tee.out
    RESULTS.mkdir(parents=True, exist_ok=True)
    command = " ".join([f"bench/{bench}.py", *sys.argv[1:]])
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    body = f"<!-- {command}, run {when} -->\n\n{tee.text.getvalue()}"
    (RESULTS / f"{bench}.md").write_text(body, encoding="utf-8")
    print(f"\nresults: bench/results/{bench}.md")
    if bench in PLOTTERS:
        print(draw(bench))


def main() -> None:
    names = sys.argv[1:] or sorted(p.stem for p in RESULTS.glob("*.md") if p.stem in PLOTTERS)
    unknown = [n for n in names if n not in PLOTTERS]
    if unknown:
        sys.exit(f"no chart for {unknown}; charts exist for: {', '.join(sorted(PLOTTERS))}")
    for name in names:
        if not (RESULTS / f"{name}.md").is_file():
            sys.exit(f"bench/results/{name}.md is missing: run bench/{name}.py first")
        print(draw(name))


if __name__ == "__main__":
    main()
