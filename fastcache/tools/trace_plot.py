"""The trace tool's picture: hit rate over the trace, and against the CPU tier's capacity (matplotlib)."""
from __future__ import annotations

import numpy as np

WINDOW = 500        # requests per point of the moving hit rate


def _moving(hits, blocks, window):
    """Hit rate over the last `window` requests, at every request."""
    h, b = np.cumsum(hits, dtype=float), np.cumsum(blocks, dtype=float)
    h[window:], b[window:] = h[window:] - h[:-window], b[window:] - b[:-window]
    return h / np.maximum(b, 1)


def plot(path, trace, replay, model, limit, sweep, args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (over, against) = plt.subplots(1, 2, figsize=(13, 4.8), constrained_layout=True)
    minutes = trace.timestamps / 60e3
    window = min(WINDOW, len(trace.requests))
    gpu, cpu, l3, blocks = (np.asarray(x) for x in (replay.gpu, replay.cpu, replay.l3, replay.blocks))
    stacks = [_moving(gpu, blocks, window), _moving(cpu, blocks, window)]
    labels, colors = ["GPU hits (replay)", "CPU-tier hits (replay)"], ["#4c72b0", "#55a868"]
    if getattr(args, "store", None):            # the store below the CPU tier (L3)
        stacks.append(_moving(l3, blocks, window))
        labels.append("store (L3) hits (replay)")
        colors.append("#dd8452")
    over.stackplot(minutes, *stacks, labels=labels, colors=colors, alpha=0.8)
    over.plot(minutes, _moving(np.add(np.add(model.gpu, model.cpu), model.l3), blocks, window), color="black",
              lw=1, ls="--", label="model, every tier")
    over.plot(minutes, _moving(limit.cpu, blocks, window), color="#c44e52", lw=1, label="infinite cache")
    store = ", store below" if getattr(args, "store", None) else ""
    over.set(xlabel="trace time (minutes)", ylabel=f"hit rate (last {window} requests)", ylim=(0, 0.6),
             title=f"hit rate over the trace: GPU {args.gpu_blocks} blocks, CPU tier {args.cpu_blocks}{store}")
    over.legend(loc="upper left", fontsize=8)

    capacities = sorted(sweep)
    against.plot(capacities, [sweep[c]["hit_rate"] for c in capacities], "o-", color="black",
                 label=f"LRU model, both tiers (GPU {args.gpu_blocks})")
    against.plot(capacities, [sweep[c]["cpu_hit_rate"] for c in capacities], "o-", color="#55a868",
                 label="LRU model, CPU-tier hits")
    rates = replay.rates()
    against.plot([args.cpu_blocks], [rates["hit_rate"]], "*", ms=16, color="#4c72b0",
                 label="this replay" + (", with the store below" if getattr(args, "store", None) else ""))
    against.axhline(limit.rates()["hit_rate"], color="#c44e52", lw=1, label="infinite cache")
    against.set(xscale="log", xlabel="CPU tier capacity (blocks of 512 tokens)", ylabel="hit rate", ylim=(0, 0.5),
                title=f"hit rate against capacity, {len(trace.requests)} requests")
    against.legend(loc="upper left", fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)
