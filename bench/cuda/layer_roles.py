"""A Gemma 3 decode step's kernels by their role in a layer, from a kernel trace
(bench/cuda/kernel_trace.cu), to compare builds that leave launches out (RESULTS.md "issue 4ap").

usage: python3 layer_roles.py TRACE.csv [TRACE.csv ...]

Reads the last complete step (from one `set_inputs` kernel to the next) with timeline.py and
names each kernel by its place in the 12B layer: np2 (the norm pair before q/k/v), qk (the q/k(/v)
product, 528 blocks), v (a Q6_K v product, 256 blocks), attn, o (480 blocks), np1 (the norm pair
after o), gu (gate/up, the 528-block product after o or np1), quant, down (264 blocks), head.
Per role: launches, critical time each (its end minus the latest end before it), duration each,
and its start minus the latest end before it (negative: launched early, waiting).
"""
import sys

from timeline import critical, read_trace, span_us

ROLES = ["np2", "qk", "v", "attn", "o", "np1", "gu", "quant", "down", "head"]


def role(name, grid, prev):
    if name.startswith("matvecr8") and grid == 528:
        return "gu" if prev in ("o", "np1") else "head" if name.endswith("q6_k") else "qk"
    if grid == 256:
        return "v"
    if name.startswith("attention"):
        return "attn"
    if grid == 480:
        return "o"
    if name == "rms_norm2":
        return "np1" if prev == "o" else "np2"
    if name.startswith("quantize"):
        return "quant"
    if grid == 264:
        return "down"
    return name


for path in sys.argv[1:]:
    _, _, step = read_trace(path)
    # (Each kernel's role depends on the one before it.)
    roles = []
    for _, _, n, g in step[1:]:
        roles.append(role(n, g, roles[-1] if roles else None))
    agg = critical(step, roles)
    print("== %s: %.1f us a step" % (path, span_us(step)))
    print("  %-6s %4s %10s %10s %11s" % ("role", "n", "crit each", "dur each", "start-prev"))
    for r in ROLES + sorted(set(agg) - set(ROLES)):
        if r in agg:
            c, cr, du, g = agg[r]
            print("  %-6s %4d %10.2f %10.2f %11.2f" % (r, c, cr / 1e3 / c, du / 1e3 / c, g / 1e3 / c))
