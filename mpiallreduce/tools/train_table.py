"""train_bench's table: each contender's communication per step, paired round by round with its
baseline, and item by item the comparisons that say whether our sync beats the others.

    round k:  none ─ step ms ─┐
              ours ─ step ms ─┴─> ours − none = its comm ms in round k   (median over the rounds)

A round's steps run interleaved with every other contender's, so a drift of the machine touches
the pair alike. The machine is shared and noisy (a round's difference varies by several ms), so
each median comes with its 95% interval (distribution-free: order statistics of the rounds), and
a comparison is called only where the interval excludes no difference.
"""

import math
import statistics

__all__ = ["table", "median_interval", "OWN_BASELINE", "COMPARISONS"]

#: a contender's own baseline, where it is not "none"
OWN_BASELINE = {"horovod": "none-horovod"}
#: (contender, weight, other): contender's comm ms against weight x the other's, round by round
#: (the last two: how far ours is from the fused loop by hand, and whether even that is half of
#: DDP's)
COMPARISONS = (
    ("mpiallreduce", 1.0, "mpi4py"),
    ("mpiallreduce", 0.5, "ddp-gloo"),
    ("ddp-mpiallreduce", 1.0, "ddp-gloo"),
    ("mpiallreduce", 1.0, "mpi4py-fused"),
    ("mpi4py-fused", 0.5, "ddp-gloo"),
)


def median_interval(values, confidence=0.95):
    """(median, low, high): the median of ``values`` and an interval that holds the true median
    with at least ``confidence`` (the order statistics k and n-1-k, k the largest with a binomial
    tail of at most (1-confidence)/2 on either side). (None, None) bounds with fewer than 6
    values."""
    ordered, n = sorted(values), len(values)
    middle = statistics.median(ordered)
    k, tail = -1, 0.0
    while k + 1 < n // 2 and tail + math.comb(n, k + 1) / 2**n <= (1 - confidence) / 2:
        k += 1
        tail += math.comb(n, k) / 2**n
    return (middle, None, None) if k < 0 else (middle, ordered[k], ordered[n - 1 - k])


def _paired(row, baseline, weight=1.0):
    """Each round's step of ``row`` less ``weight`` x ``baseline``'s in the same round (seconds)."""
    return [
        a - weight * b
        for a, b in zip(row["rounds_step_s"], baseline["rounds_step_s"], strict=False)
    ]


def _span(low, high):
    return "      n/a" if low is None else f"{low * 1e3:>+5.1f}..{high * 1e3:<+5.1f}"


def table(rows, args, size, nodes, gradient_bytes, model):
    steps_per_epoch = args.epoch_samples / (args.local_batch * size)
    lines = [
        f"training end to end: {size} ranks on {nodes} node(s), {args.device}, {model} "
        f"({gradient_bytes / 2**20:.1f} MiB of float32 gradients), local batch {args.local_batch}, "
        f"median of {args.rounds} interleaved rounds of {args.steps_per_round} steps; "
        f"an epoch = {args.epoch_samples} samples = {steps_per_epoch:.0f} steps",
        f"{'contender':<18} {'samples/s':>10} {'step ms':>8} {'comm ms/step':>12} "
        f"{'95% interval':>13} {'comm s/epoch':>12} {'comm share':>10} {'vs own ms':>9} "
        f"{'max |diff| vs 1 process':>24}",
    ]
    for name, row in rows.items():
        base = name.startswith("none")
        comm_s, low, high = (
            (0.0, None, None) if base else median_interval(_paired(row, rows["none"]))
        )
        if (
            name in OWN_BASELINE
        ):  # (its rounds ran apart from none's, after them: no paired interval)
            low = high = None
        own_s = (
            0.0 if base else statistics.median(_paired(row, rows[OWN_BASELINE.get(name, "none")]))
        )
        comm_s, own_s = max(comm_s, 0.0), max(own_s, 0.0)
        row.update(
            comm_s_per_step=comm_s,
            comm_s_interval=[low, high],
            comm_s_per_epoch=comm_s * steps_per_epoch,
            comm_s_vs_own_baseline=own_s,
            comm_share=comm_s / row["step_s"],
            samples_per_s=args.local_batch * size / row["step_s"],
        )
        lines.append(
            f"{name:<18} {row['samples_per_s']:>10,.0f} {row['step_s'] * 1e3:>8.1f} "
            f"{comm_s * 1e3:>12.1f} {_span(low, high):>13} {row['comm_s_per_epoch']:>12.2f} "
            f"{row['comm_share']:>10.0%} {own_s * 1e3:>9.1f} {row['max_abs_difference']:>24.2e}"
        )
    compared = [(a, w, b) for a, w, b in COMPARISONS if a in rows and b in rows]
    if compared:
        lines.append(
            "round by round (comm ms; the steps' difference in each round, median and 95% "
            "interval):"
        )
    for a, weight, b in compared:
        middle, low, high = median_interval(
            _paired(rows[a], rows[b], 1.0)
            if weight == 1.0
            else [
                x - weight * y
                for x, y in zip(
                    _paired(rows[a], rows["none"]), _paired(rows[b], rows["none"]), strict=False
                )
            ]
        )
        verdict = (
            "not measured apart"
            if low is None or low <= 0 <= high
            else "lower"
            if high < 0
            else "higher"
        )
        other = b if weight == 1.0 else f"{weight:g} x {b}"
        lines.append(
            f"  {a} - {other}: {middle * 1e3:+.1f} ms ({_span(low, high).strip()}): {a} {verdict}"
        )
    return "\n".join(lines)
