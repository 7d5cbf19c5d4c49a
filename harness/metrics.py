"""What the experiments measure of a run, from outside the engine: Meter listens to the engine's steps, and
metrics() turns what it heard into the table's figures (vLLM's benchmark names: TTFT, TPOT, latency)."""

import math
import time
from types import SimpleNamespace

import numpy as np

from harness.contiguous import ContiguousEngine
from harness.observer import Observer
from paged import blocks_for
from scheduler import PagedEngine
from sequence import RequestStatus, SequenceStatus

WALL_CLOCK = SimpleNamespace(now=time.perf_counter, sleep=time.sleep)  # tests swap in fakes


class Meter(Observer):
    """What the experiments read of an engine, heard from it as one of its observers (the engine keeps no
    measurements), on `clock`: each request's arrival, first token and end; each step's seconds (plan to
    sampled tokens), running sequences, keys attended and KV slots; prefill tokens; admitted and
    prefix-cached tokens; preemptions; blocks swapped out and in, and the seconds their copies took; tokens
    whose K/V were computed again, and their share of their steps' seconds."""

    def __init__(self, engine, clock=None):
        self.engine = engine
        self.clock = clock or WALL_CLOCK
        # request -> clock time: it arrived (was added, unless the harness set the time it arrived at), drew
        # its first token (a beam: its first log-probabilities), and was done
        self.arrival = {}
        self.first_token = {}
        self.done = {}
        self.plan = []
        self.last_plan = []  # the step before's: with async steps (ext/async_steps.py) a request ends a step later
        self.steps = []  # one dict per step
        self.step_start = None
        self.prefill_tokens = 0
        self.admitted_tokens = 0
        self.cached_tokens = 0  # of the admitted: found in the prefix cache
        self.num_preemptions = 0
        self.swap_start = None
        self.swapped_out_blocks = self.swapped_in_blocks = 0
        self.swap_out_s = self.swap_in_s = 0.0
        self.swap_fallbacks = 0  # preempted sequences recomputed though the engine swaps: its swap space was full
        self.swapped_in_now = set()  # swapped in, about to be admitted: not prefix-cache lookups
        self.computed = {}  # sequence -> the most tokens whose K/V it has had at the end of a step
        self.recomputed_tokens = 0
        self.step_share = 0.0
        self.recompute_s = 0.0  # each step's seconds shared among its tokens: an estimate
        self.proposed_tokens = 0  # speculative decoding (ext/speculative.py): tokens proposed and verified,
        self.accepted_tokens = 0  # those accepted,
        self.verify_steps = 0  # and the sequences' steps that verified some
        self.speculation = {}  # request -> [proposed, accepted, verify steps]
        engine.observers.append(self)

    def added(self, request):
        self.arrival.setdefault(request, self.clock.now())

    def planned(self, plan):
        self.last_plan, self.plan = self.plan, plan
        self.step_start = self.clock.now()
        self.prefill_tokens += sum(n for s, n in plan if s.status is SequenceStatus.PREFILLING)
        again = [min(s.num_computed + n, self.computed.get(s, 0)) - s.num_computed for s, n in plan]
        again = sum(max(0, a) for a in again)
        self.recomputed_tokens += again
        self.step_share = again / sum(n for _, n in plan)

    def sampled(self, plan):
        engine = self.engine
        keys = sum(s.num_computed for s, _ in plan)
        seconds = self.clock.now() - self.step_start
        self.recompute_s += seconds * self.step_share
        self.steps.append(dict(seconds=seconds, running=len(engine.running), keys=keys, **kv_slots(engine)))

    def stepped(self):
        now = self.clock.now()
        for s in self.engine.running:
            self.computed[s] = max(self.computed.get(s, 0), s.num_computed)
        for s, _ in self.last_plan + self.plan:
            if s.status in (SequenceStatus.DECODING, SequenceStatus.DONE):  # it has drawn
                self.first_token.setdefault(s.request, now)
            if s.request.status is RequestStatus.DONE:
                self.done.setdefault(s.request, now)

    def admitted(self, group):
        looked_up = [x for x in group if x not in self.swapped_in_now]
        self.admitted_tokens += sum(len(x.tokens) for x in looked_up)
        self.cached_tokens += sum(x.num_computed for x in looked_up)
        self.swapped_in_now = set()

    def swapping(self):
        self.swap_start = self.clock.now()

    def preempted(self, sequence):
        self.num_preemptions += 1
        if self.swap_start is not None:  # its K/V went to the swap space since swapping()
            self.swapped_out_blocks += len(self.engine.swapped[sequence])
            self.swap_out_s += self.clock.now() - self.swap_start
        elif getattr(self.engine, "swap_blocks", 0):  # the swap space (ext/swap.py) could not take it
            self.swap_fallbacks += 1
        self.swap_start = None

    def verified(self, sequence, proposed, accepted):
        self.proposed_tokens += proposed
        self.accepted_tokens += accepted
        self.verify_steps += 1
        stats = self.speculation.setdefault(sequence.request, [0, 0, 0])
        stats[0] += proposed
        stats[1] += accepted
        stats[2] += 1

    def swapped_in(self, sequence, num_blocks):
        self.swapped_in_blocks += num_blocks
        self.swap_in_s += self.clock.now() - self.swap_start
        self.swap_start = None
        self.swapped_in_now.add(sequence)


def kv_slots(engine):
    """KV token slots: allocated, holding a token's K/V (once, however many sequences share it), and
    allocated ahead of the tokens to come (a paged prompt's blocks, a contiguous reservation)."""
    used = sum(s.num_computed for s in engine.running)
    if isinstance(engine, ContiguousEngine):  # unbudgeted, torch.cat holds just the tokens
        allocated = used if engine.kv_budget is None else engine.reserved
        return dict(allocated=allocated, used=used, ahead=allocated - used)
    bs, full, partial = engine.block_size, set(), {}
    for s in engine.running:  # a shared block is full, or the shared last block of forks that have not written
        k, n = divmod(s.num_computed, bs)
        full.update(s.block_table[:k])
        partial.update({s.block_table[k]: n} if n else {})
    used = len(full) * bs + sum(n for block, n in partial.items() if block not in full)
    allocated = (engine.allocator.num_blocks - engine.allocator.num_free()) * bs
    ahead = sum(len(s.block_table) - blocks_for(s.num_computed, bs) for s in engine.running) * bs
    return dict(allocated=allocated, used=used, ahead=ahead)


def returned(r):
    """What a request gives back: its n samples, or its one sequence (the best beam; the JSON lists all)."""
    return r.sequences if r.params.n > 1 else r.sequences[:1]


LABELS = {
    "contiguous": "contiguous",
    "contiguous_max": "contiguous, reserve max",
    "paged": "paged",
    "contiguous_pow2": "contiguous, reserve pow2",
    "contiguous_oracle": "contiguous, reserve oracle",
    "paged_prefix": "paged + prefix cache",
}
TABLE_KEYS = [
    "same_output_pct",
    "same_prefix_pct",
    "output_tokens",
    "wall_s",
    "output_tok_s",
    "ttft_ms_mean",
    "ttft_ms_p90",
    "ttft_ms_p99",
    "tpot_ms_mean",
    "latency_ms_mean",
    "latency_ms_p50",
    "latency_ms_p90",
    "latency_ms_p99",
    "normalized_latency_ms",
    "request_rate",
    "steps",
    "prefill_tokens",
    "prefix_hit_rate",
    "preemptions",
    "swapped_out_blocks",
    "swapped_in_blocks",
    "swap_mb",
    "swap_out_ms",
    "swap_in_ms",
    "swap_fallbacks",
    "recomputed_tokens",
    "recompute_ms",
    "running_peak",
    "running_mean",
    "kv_budget_slots",
    "kv_used_pct_mean",
    "kv_slots_allocated_peak",
    "kv_slots_used_peak",
    "kv_waste_pct",
    "kv_ahead_pct",
    "spec_proposed_tokens",
    "spec_accepted_tokens",
    "spec_verify_steps",
    "spec_acceptance_pct",
    "spec_tokens_per_verify",
    "num_blocks",
    "block_size",
]


def percentile(values, p):
    """Linear interpolation between closest ranks (numpy's default; Hyndman and Fan's type 7), used for
    every percentile here: with two values, p90 lies 90% of the way from the smaller to the larger."""
    return float(np.percentile(values, p)) if values else None


def mean(values):
    values = list(values)
    return sum(values) / len(values) if values else None


def metrics(meter, wall_s, rate, kv_budget):
    engine, reqs, stats = meter.engine, list(meter.done), meter.steps
    arrival, first_token, done = meter.arrival, meter.first_token, meter.done
    out = sum(len(s.generated) for r in reqs for s in returned(r))
    ttft = [(first_token[r] - arrival[r]) * 1000 for r in reqs]
    latency = [(done[r] - arrival[r]) * 1000 for r in reqs]  # end to end, from arrival to the last token
    # a request's length: its longest returned sequence (n samples end apart with eos; the latency runs to the last)
    length = {r: max(len(s.generated) for s in returned(r)) for r in reqs}
    tpot = [(done[r] - first_token[r]) * 1000 / (length[r] - 1) for r in reqs if length[r] > 1]
    peak = max(stats, key=lambda s: s["allocated"])
    m = dict(
        output_tokens=out,
        wall_s=wall_s,
        output_tok_s=out / wall_s,
        ttft_ms_mean=mean(ttft),
        ttft_ms_p90=percentile(ttft, 90),
        ttft_ms_p99=percentile(ttft, 99),
        tpot_ms_mean=mean(tpot),  # None (not applicable) when no request made a second token
        latency_ms_mean=mean(latency),
        latency_ms_p50=percentile(latency, 50),
        latency_ms_p90=percentile(latency, 90),
        latency_ms_p99=percentile(latency, 99),
        normalized_latency_ms=mean(t / length[r] for t, r in zip(latency, reqs)),
        request_rate=rate,
        steps=len(stats),
        prefill_tokens=meter.prefill_tokens,
        preemptions=meter.num_preemptions,
        recomputed_tokens=meter.recomputed_tokens,
        recompute_ms=meter.recompute_s * 1000,  # estimated: each step's time shared among its tokens
        running_peak=max(s["running"] for s in stats),
        running_mean=mean(s["running"] for s in stats),
        kv_budget_slots=kv_budget,
        kv_used_pct_mean=100 * mean(s["used"] / (kv_budget or max(1, s["allocated"])) for s in stats),
        kv_slots_allocated_peak=peak["allocated"],
        kv_slots_used_peak=peak["used"],
        # at peak allocation: unfilled tails of last blocks (fragmentation), and blocks held ahead of prefill
        kv_waste_pct=100 * (peak["allocated"] - peak["used"] - peak["ahead"]) / max(1, peak["allocated"]),
        kv_ahead_pct=100 * peak["ahead"] / max(1, peak["allocated"]),
        prefix_hit_rate=None,
    )
    if isinstance(engine, PagedEngine):
        m.update(
            num_blocks=engine.allocator.num_blocks,
            block_size=engine.block_size,
            prefix_hit_rate=meter.cached_tokens / max(1, meter.admitted_tokens),
            preemption="swap" if getattr(engine, "swap_blocks", 0) else "recompute",  # ext/swap.py
            swap_blocks=getattr(engine, "swap_blocks", 0),
            swapped_out_blocks=meter.swapped_out_blocks,
            swapped_in_blocks=meter.swapped_in_blocks,
            # both ways; a block is its K and V in every layer
            swap_mb=(meter.swapped_out_blocks + meter.swapped_in_blocks) * engine.kv_pool[:, :, 0].nbytes / 2**20,
            swap_out_ms=meter.swap_out_s * 1000,
            swap_in_ms=meter.swap_in_s * 1000,
            swap_fallbacks=meter.swap_fallbacks,
        )
    if getattr(engine, "num_speculative_tokens", 0):
        m.update(speculation(meter.proposed_tokens, meter.accepted_tokens, meter.verify_steps))
    return m


def speculation(proposed, accepted, verify_steps):
    """Speculative decoding's figures: tokens proposed and accepted, the share accepted, and the tokens a
    sequence gained per verify step (its accepted proposals and its one drawn token)."""
    return dict(
        spec_proposed_tokens=proposed,
        spec_accepted_tokens=accepted,
        spec_verify_steps=verify_steps,
        spec_acceptance_pct=100 * accepted / proposed if proposed else None,
        spec_tokens_per_verify=(accepted + verify_steps) / verify_steps if verify_steps else None,
    )


def cell(v):
    if v is None:
        return "—"
    if isinstance(v, int) or math.isinf(v):
        return f"{v:,}"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:,.2f}"


def table(runs):
    """One column per run, then each run's speed relative to the first."""
    names = list(runs)
    width = max(len(LABELS[n]) for n in names) + 2
    rows = [f"{'metric':<24}" + "".join(f"{LABELS[n]:>{width}}" for n in names)]
    rows += [f"{k:<24}" + "".join(f"{cell(runs[n].get(k)):>{width}}" for n in names) for k in TABLE_KEYS]
    first = runs[names[0]]["output_tok_s"]
    rows += (
        [
            f"output tok/s relative to {LABELS[names[0]]}: "
            + ", ".join(f"{LABELS[n]} {runs[n]['output_tok_s'] / first:.2f}x" for n in names[1:])
        ]
        if len(names) > 1
        else []
    )
    return "\n".join(rows)


def sweep_table(rows, columns):
    """rows: (label, dict) pairs; columns: (header, key) pairs -> one line per row, one column per key."""
    width = max([22] + [len(label) + 2 for label, _ in rows])
    lines = [f"{'':<{width}}" + "".join(f"{header:>16}" for header, _ in columns)]
    lines += [f"{label:<{width}}" + "".join(f"{cell(row.get(key)):>16}" for _, key in columns) for label, row in rows]
    return "\n".join(lines)


def outputs(r):
    return [s.generated for s in returned(r)]


def agreement(a, b):
    """The share of two outputs that is identical before their first difference: 1.0 when they are equal."""
    if a == b:
        return 1.0
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return same / max(len(a), len(b))
