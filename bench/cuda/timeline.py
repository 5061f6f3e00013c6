"""Where a decode step's time goes, from a kernel trace (bench/cuda/kernel_trace.cu).

usage: python3 timeline.py TRACE.csv

A step starts at a `set_inputs` kernel; the last complete step is read. With programmatic
dependent launch kernels overlap, so a kernel's share of the step is its *critical* time: its end
minus the latest end before it (what the step would lose without it). Per kernel name and grid:
count, critical time (total and each), duration each, and how long before the previous kernel's
end it started (negative: it was launched early and waited). Then the kernels of the middle of the
step, one by one.
"""
import collections
import sys


def read_trace(path):
    """All kernels of a trace as (start ns, end ns, name, grid), sorted, and its last complete step."""
    ks = []
    for line in open(path):
        p = line.rstrip("\n").split(",")
        if len(p) >= 4:
            ks.append((int(p[0]), int(p[1]), p[2].split("(")[0], int(p[3])))
    ks.sort()
    starts = [i for i, k in enumerate(ks) if k[2].startswith("set_inputs")]
    if len(starts) < 2:
        sys.exit("%s: fewer than two steps (set_inputs kernels) in the trace" % path)
    return ks, len(starts), ks[starts[-2]:starts[-1]]


def span_us(step):
    """Microseconds from the step's first start to its last end."""
    return (max(k[1] for k in step) - step[0][0]) / 1e3


def critical(step, keys):
    """Per key over the step's kernels after its first (`keys`: one for each of them, in order):
    [count, critical ns, duration ns, start minus the latest end before it ns], summed."""
    agg = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    prev_end = step[0][1]
    for (s, e, _, _), key in zip(step[1:], keys):
        a = agg[key]
        a[0] += 1
        a[1] += max(0, e - prev_end)
        a[2] += e - s
        a[3] += s - prev_end
        prev_end = max(prev_end, e)
    return agg


def main():
    ks, steps, step = read_trace(sys.argv[1])
    print("%d kernels, %d steps; the last complete step: %d kernels, %.1f us from its first start to its last end"
          % (len(ks), steps, len(step), span_us(step)))
    agg = critical(step, ["%s/%d" % (n, g) for _, _, n, g in step[1:]])
    print("%-28s %5s %10s %10s %10s %12s" % ("kernel/grid", "n", "crit us", "crit each", "dur each", "start-prev"))
    for n, (c, d, du, g) in sorted(agg.items(), key=lambda x: -x[1][1]):
        print("%-28s %5d %10.1f %10.2f %10.2f %12.2f" % (n, c, d / 1e3, d / 1e3 / c, du / 1e3 / c, g / 1e3 / c))
    print("critical sum %.1f us" % (sum(a[1] for a in agg.values()) / 1e3))
    mid = len(step) // 2
    print("-- the middle of the step: start (us from the first shown), duration, end minus the previous end")
    base, pe = step[mid][0], step[mid - 1][1]
    for s, e, n, g in step[mid:mid + 20]:
        print("%-24s %5d start %8.2f dur %7.2f dend %7.2f" % (n, g, (s - base) / 1e3, (e - s) / 1e3, (e - pe) / 1e3))
        pe = e


if __name__ == "__main__":
    main()
