"""Pictures of runs: the block pool over a run (PoolMap, which listens to the paged engine), and the
experiments' plots (KV slots, running sequences and step times per step; a rate sweep's latency and batch)."""

import numpy as np

from harness.metrics import LABELS
from harness.observer import Observer

POOL_STATES = {  # a block's state after a step, its color in the picture
    "free": "#f4f4f4",
    "held by one sequence": "#4c72b0",
    "shared (reference count > 1)": "#dd8452",
    "cached, free (a prefix hit can revive it)": "#8fd18f",
    "copied on write this step": "#c44e52",
}
FREE, HELD, SHARED, CACHED, COPIED = range(len(POOL_STATES))


class PoolMap(Observer):
    """The block pool over a run, heard from the paged engine as one of its observers, as Meter is: after
    every step, each block's state, and the steps at which sequences were admitted and preempted. draw()
    makes the picture: one row per block, one column per step.

        pool_map = PoolMap(engine); engine.run(requests); pool_map.draw("pool.png")"""

    def __init__(self, engine):
        self.engine = engine
        self.states = []  # per step: (num_blocks,) int8, each block's state
        self.admissions = []  # the step of each admitted sequence
        self.preemptions = []  # the step of each preempted one
        self.copies = []  # blocks copied on write in the step being recorded
        engine.observers.append(self)

    def admitted(self, group):
        self.admissions += [len(self.states)] * len(group)

    def preempted(self, sequence):
        self.preemptions.append(len(self.states))

    def copied(self, block):
        self.copies.append(block)

    def stepped(self):
        allocator = self.engine.allocator
        ref_count = np.array(allocator.ref_count)
        states = np.where(ref_count > 1, SHARED, np.where(ref_count == 1, HELD, FREE)).astype(np.int8)
        states[list(allocator.cached_free)] = CACHED
        # a copy is held by the sequence that made it, and by its forks if a beam step forked it; a beam that
        # died in the step let go of its copy
        states[[block for block in self.copies if ref_count[block] > 0]] = COPIED
        self.states.append(states)
        self.copies = []

    def draw(self, path, title=""):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import ListedColormap
        from matplotlib.patches import Patch
        from matplotlib.ticker import FuncFormatter, MaxNLocator

        grid = np.stack(self.states, axis=1)  # (num_blocks, steps)
        steps = np.arange(grid.shape[1])
        fig, (events, pool) = plt.subplots(
            2, 1, figsize=(12, 6.5), sharex=True, gridspec_kw=dict(height_ratios=[1, 5], hspace=0.05)
        )
        admitted = np.bincount(self.admissions, minlength=len(steps))  # each happened inside a recorded step
        preempted = np.bincount(self.preemptions, minlength=len(steps))
        events.bar(steps, admitted, width=1.0, color="#55a868", label=f"admitted ({len(self.admissions)})")
        events.bar(steps, -preempted, width=1.0, color="#c44e52", label=f"preempted ({len(self.preemptions)})")
        events.axhline(0, color="black", linewidth=0.5)
        events.set(ylabel="sequences")
        events.yaxis.set_major_locator(MaxNLocator(nbins=3, integer=True))
        events.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{abs(y):g}"))  # preemptions point down
        events.legend(loc="upper right", fontsize=8)
        colors = ListedColormap(list(POOL_STATES.values()))
        pool.imshow(grid, cmap=colors, vmin=-0.5, vmax=len(POOL_STATES) - 0.5, aspect="auto", interpolation="nearest")
        pool.set(xlabel="step", ylabel="block")
        patches = [Patch(color=c, label=name) for name, c in POOL_STATES.items()]
        pool.legend(handles=patches, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, fontsize=8)
        events.set_title(title or f"the block pool: {grid.shape[0]} blocks over {grid.shape[1]} steps")
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)


def plot(all_stats, sweep, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if sweep:  # the rate sweep: the paper's Fig. 12 (latency) and Fig. 13 (batch size) axes
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for name in sweep[0]["runs"]:
            rates = [point["request_rate"] for point in sweep]
            axes[0].plot(
                rates, [point["runs"][name]["normalized_latency_ms"] for point in sweep], "o-", label=LABELS[name]
            )
            axes[1].plot(rates, [point["runs"][name]["running_mean"] for point in sweep], "o-", label=LABELS[name])
        panels = [
            ("normalized latency", "request rate (req/s)", "ms per output token"),
            ("mean batch size", "request rate (req/s)", "sequences running at once"),
        ]
    else:
        fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
        for name, stats in all_stats.items():
            axes[0].plot([s["allocated"] for s in stats], label=LABELS[name])
            axes[1].plot([s["running"] for s in stats], label=LABELS[name])
            axes[2].scatter([s["keys"] for s in stats], [1000 * s["seconds"] for s in stats], s=6, label=LABELS[name])
        axes[2].set_yscale("log")  # a whole-batch prefill step would flatten the rest
        panels = [
            ("KV slots allocated", "step", "slots"),
            ("running sequences", "step", "sequences"),
            ("step time vs context in batch", "keys attended in the step", "ms"),
        ]
    for ax, (name, x, y) in zip(axes, panels):
        ax.set(title=name, xlabel=x, ylabel=y)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def block_size_axes(ax, block_sizes):
    """Block sizes on a log2 x axis, each labeled; a log y axis labeled in plain numbers (1, 2, 5, 10, ...)."""
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    ax.set_xscale("log", base=2)
    ax.set_xticks(block_sizes, [str(b) for b in block_sizes])
    ax.set_xlabel("block size (tokens)")
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())


def plot_block_sizes(results, path, title):
    """The block-size sweep: normalized latency against block size for each length mix (the vLLM paper's Sec. 7.2),
    and the KV memory each needed at its peak, allocated and holding tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (latency, memory) = plt.subplots(1, 2, figsize=(12, 4.5))
    for (mix, runs), color in zip(results.items(), ["#4c72b0", "#dd8452"]):
        block_sizes = list(runs)
        latency.plot(block_sizes, [m["normalized_latency_ms"] for m in runs.values()], "o-", color=color, label=mix)
        for key, style, what in (
            ("kv_allocated_peak_mb", "o-", "allocated"),
            ("kv_used_peak_mb", "o--", "holding tokens"),
        ):
            memory.plot(block_sizes, [m[key] for m in runs.values()], style, color=color, label=f"{mix}, {what}")
    latency.set(title="normalized latency", ylabel="ms per output token (mean over requests)")
    memory.set(title="KV memory at its peak", ylabel="MB")
    save_block_size_figure(fig, (latency, memory), block_sizes, title, path)


def plot_preemption(points, path, title):
    """Recompute against swap at each block size: the microbenchmark's times (the vLLM paper's Fig. 19a) and the
    normalized latency of a run under memory pressure with each (its Fig. 19b)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (micro, latency) = plt.subplots(1, 2, figsize=(12, 4.5))
    block_sizes = [p["block_size"] for p in points]
    for label, times in [
        ("recompute", [p["recompute_ms"] for p in points]),
        ("swap out", [p["swap_out_ms"] for p in points]),
        ("swap in", [p["swap_in_ms"] for p in points]),
        ("swap out + in", [p["swap_out_ms"] + p["swap_in_ms"] for p in points]),
    ]:
        micro.plot(block_sizes, times, "o-" if label in ("recompute", "swap out + in") else "o:", label=label)
    for mode in ("recompute", "swap"):
        latency.plot(block_sizes, [p[mode]["normalized_latency_ms"] for p in points], "o-", label=mode)
    micro.set(title="one batch preempted and readmitted (Fig. 19a)", ylabel="ms")
    latency.set(title="end to end under memory pressure (Fig. 19b)", ylabel="ms per output token (mean over requests)")
    save_block_size_figure(fig, (micro, latency), block_sizes, title, path)


def save_block_size_figure(fig, axes, block_sizes, title, path):
    """Block sizes on a log-2 axis under each panel, a legend in each, the title, then the file."""
    import matplotlib.pyplot as plt

    for ax in axes:
        block_size_axes(ax, block_sizes)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
