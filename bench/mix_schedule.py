"""What a mixture schedule costs the server: planning one epoch of a mix, with and without.

A mix without a schedule orders its epoch in closed form (NOTE [ Mixed order ]); one with a
schedule decides each global batch's composition by carried credits, a few Python steps per
global batch (NOTE [ Scheduled mix ]). A session plans an epoch when it opens and when a
stream starts a new epoch (cached after). This times ``plan_mix_epoch`` for both, on the same
sizes, seed and batch sizes, in alternating rounds, and prints the best of ``--repeats`` and
the ratio, per global batch size: the cost grows with the epoch's global batches.

Run: ``python bench/mix_schedule.py --rows 3000000,1000000 --global-batches 64,512,4096``
"""

from __future__ import annotations

import argparse
import time

from _common import machine_lines, markdown_table

from batchd._wire.schedule import WeightSchedule
from batchd_server.planning.mixing import MixOptions, MixSourceOptions, plan_mix_epoch
from batchd_server.planning.sampling import SamplerOptions


def _mix(weights: list[float], schedule: WeightSchedule | None) -> MixOptions:
    sources = tuple(MixSourceOptions(dataset=f"s{i}", weight=w) for i, w in enumerate(weights))
    return MixOptions(sources=sources, schedule=schedule)


def _best_s(fn: object, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="3000000,1000000", help="rows of each source")
    parser.add_argument("--global-batches", default="64,512,4096", help="batch sizes (1 rank)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sizes = [int(x) for x in args.rows.split(",")]
    weights = [1.0 / (i + 1) for i in range(len(sizes))]
    flipped = tuple(reversed(weights))
    rows = []
    for batch in (int(x) for x in args.global_batches.split(",")):
        options = SamplerOptions(batch_size=batch, seed=1)
        plain = _mix(weights, None)
        epoch_batches = plan_mix_epoch(sizes, plain, options, 0).num_batches
        middle = epoch_batches // 2
        step = _mix(weights, WeightSchedule(tuple(weights), ((middle, flipped),), "step"))
        linear = _mix(
            weights,
            WeightSchedule(tuple(weights), ((0, tuple(weights)), (middle, flipped)), "linear"),
        )
        times = {name: 0.0 for name in ("none", "step", "linear")}
        for name, mix in (("none", plain), ("step", step), ("linear", linear)):
            times[name] = _best_s(
                lambda mix=mix, options=options: plan_mix_epoch(sizes, mix, options, 0),
                args.repeats,
            )
        rows.append(
            [
                str(batch),
                f"{epoch_batches:,}",
                f"{times['none'] * 1e3:.0f}",
                f"{times['step'] * 1e3:.0f}",
                f"{times['linear'] * 1e3:.0f}",
                f"{times['step'] / times['none']:.1f}x",
                f"{(times['step'] - times['none']) / epoch_batches * 1e6:.1f}",
            ]
        )
    print(f"sources: {sizes} rows, weights {weights}; one change (step) or a ramp (linear) to")
    print(f"{list(flipped)} at the epoch's middle; best of {args.repeats}; one rank.")
    print(*machine_lines(), sep="\n")
    header = [
        "global batch",
        "batches/epoch",
        "none ms",
        "step ms",
        "linear ms",
        "step/none",
        "(step - none) µs per global batch",
    ]
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
