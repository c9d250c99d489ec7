#!/usr/bin/env python3
"""Renders a dpsync timeline (DPSYNC_TIMELINE's Chrome trace-event JSON) to a PNG.

    python3 scripts/timeline-png.py trace.json out.png [--title T] [--last-ms MS]

One row per context (process and thread names from the trace), spans as bars nested by depth
(the call, its agreement and buckets, a world's levels inside a bucket), grad_ready marks as
ticks. --last-ms keeps only the final MS milliseconds (a few steps of a long run).
"""
import argparse
import json
import sys

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    print("timeline-png: skipped: matplotlib is not installed (pip install matplotlib)")
    sys.exit(0)

COLORS = {
    "dpsync_allreduce_grads": "#4c72b0",
    "dpsync_allreduce": "#4c72b0",
    "dpsync_broadcast": "#55a868",
    "dpsync_average": "#8172b2",
    "dpsync_bmuf_step": "#c44e52",
    "dpsync_bmuf_init": "#c44e52",
    "agree": "#dd8452",
    "allreduce bucket": "#64b5cd",
    "broadcast bucket": "#8de5a1",
    "local sum": "#ccb974",
    "across ranks": "#da8bc3",
    "spread": "#937860",
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("png")
    ap.add_argument("--title", default="dpsync timeline")
    ap.add_argument("--last-ms", type=float, default=0.0)
    args = ap.parse_args()
    with open(args.trace) as f:
        events = json.load(f)
    names = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names[(e["pid"], e["tid"])] = e["args"]["name"]
    spans = [e for e in events if e.get("ph") == "X"]
    marks = [e for e in events if e.get("ph") == "i"]
    if not spans:
        sys.exit("timeline-png: no spans in " + args.trace)
    end = max(e["ts"] + e["dur"] for e in spans)
    begin = end - args.last_ms * 1000 if args.last_ms > 0 else min(e["ts"] for e in spans)
    spans = [e for e in spans if e["ts"] + e["dur"] >= begin]
    marks = [e for e in marks if e["ts"] >= begin]
    rows = sorted({(e["pid"], e["tid"]) for e in spans})
    # Depth of each span: how many spans of its row contain it.
    fig, ax = plt.subplots(figsize=(12, 1.2 + 1.1 * len(rows)))
    seen = set()
    for y, row in enumerate(rows):
        mine = sorted((e for e in spans if (e["pid"], e["tid"]) == row), key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in mine:
            while stack and stack[-1] < e["ts"] + 1e-9:
                stack.pop()
            depth = len(stack)
            stack.append(e["ts"] + e["dur"])
            color = COLORS.get(e["name"], "#999999")
            label = e["name"] if e["name"] not in seen else None
            seen.add(e["name"])
            ax.broken_barh([((e["ts"] - begin) / 1000, e["dur"] / 1000)],
                           (y + depth * 0.22, 0.2), facecolors=color, label=label)
        for m in (m for m in marks if (m["pid"], m["tid"]) == row):
            ax.plot([(m["ts"] - begin) / 1000] * 2, [y - 0.05, y + 0.0], color="black", lw=0.6)
    ax.set_yticks([y + 0.3 for y in range(len(rows))])
    ax.set_yticklabels([names.get(r, f"pid {r[0]} tid {r[1]}") for r in rows])
    ax.set_xlabel("ms")
    ax.set_title(args.title)
    ax.legend(loc="upper right", fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print(f"timeline-png: {len(spans)} spans, {len(marks)} marks -> {args.png}")


if __name__ == "__main__":
    main()
