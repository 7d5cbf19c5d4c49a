"""The whole forward as ONE compiled graph, with the step's attention as a custom op, as vLLM V1 builds its
CPU step, against the engine as it runs (eager around prepacked oneDNN GEMMs and the compiled decode
attention), on bench/vllm_compare.py's workloads and weights.

    python bench/compile_graph.py [--workloads tiny/decode,tiny/mixed,gpt2/decode] [--dtype float32] [--repeats 3]
                                  [--gelu-postop on|off] [--profile]

The graph is torch.compile(model.forward, dynamic=True) with inductor's freezing (weights constant and
prepacked by inductor, the small ops between GEMMs fused; by default inductor also folds each GELU and
residual add into the oneDNN linear before it, as post-ops: --gelu-postop off keeps GELU out of it). The
model's seam stays batch.attend(layer, q, k, v): the graph gets a GraphBatch whose attend calls the op
nanogpt::attend(q, k, v, layer), which dynamo cannot see into; the op runs the step's real StepBatch, set
in a context before the forward, so the step's tables never enter the graph or its guards (vLLM's
unified_attention works the same way). Token and sampler counts are padded to at least 2, so that no size
of 1 specializes the graph. The graphed model is not prepacked: freezing packs its own weights. The graph
count is printed after the warm-up and after the timed runs: a rise means recompiles (each workload's
model is new to the process, so a second shape's first graphs may show there too). Both variants warm up
on other prompts (the compile is timed), then alternate in one process, greedy; the ratio is taken per
repeat, and outputs are compared token for token.

--profile adds, per workload, torch.profiler's view of one timed run of each variant: the ops and kernels
that take the most self CPU time, per step, and how many separate aten::gelu and layer-norm passes a step
runs (inside the graph, inductor fuses them with the adds and copies around them into its own cpp_fused_*
kernels, which inductor's kernel profiling names). Kernel profiling is switched on before anything compiles,
so with --profile the timed runs of both variants also carry its small cost per compiled kernel.
"""

import argparse
import os
import sys
import time
from typing import NamedTuple

import torch
import torch._inductor.config
import torch.nn.functional as F
from torch._dynamo.utils import counters

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from bench.archive.compile_step import fmt
from bench.vllm_compare import WORKLOADS, cpu_line, export, parse, prompts_for
from ext import ServingEngine
from harness.checkpoints import load_checkpoint
from harness.observer import Observer
from harness.tuning import prepack
from paged import blocks_for
from sequence import Request

MIN_SIZE = 2  # a dimension of size 1 would specialize the graph


class ForwardContext:
    batch = None  # the StepBatch of the forward running now: the attention op reads it


@torch.library.custom_op("nanogpt::attend", mutates_args=())
def attend_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """q, k, v: (N', H, D), padded past the step's N tokens -> (N', H, D): the step's attention, which
    writes the layer's new K/V into the pool and reads the cached ones, through the real batch."""
    batch = ForwardContext.batch
    n = len(batch.host_positions)
    # The op runs inside the graph's call, under torch.compile(dynamic=True)'s setting, which would compile
    # the decode attention with every size symbolic (heads, head size, block size): a slower kernel (36 ms
    # against 20 a GPT-2 mixed step, 2026-11-25). Static by default, as in the eager engine.
    with torch._dynamo.config.patch(assume_static_by_default=True):
        out = batch.attend(layer, q[:n], k[:n], v[:n])
    return F.pad(out, (0, 0, 0, 0, 0, q.shape[0] - n))


@attend_op.register_fake
def _(q, k, v, layer):
    return torch.empty_like(q)


class GraphBatch(NamedTuple):
    """What the graph sees of the step: positions (N',) and logit rows (S',), padded."""

    positions: torch.Tensor
    logit_rows: torch.Tensor

    def attend(self, layer, q, k, v):
        return attend_op(q, k, v, layer)


def graph_forward(model):
    """-> forward(batch) -> logits (S, V), through one compiled graph of the whole model."""
    compiled = torch.compile(model.forward, dynamic=True)

    def forward(batch):
        n = batch.idx.shape[0]
        S = batch.logit_rows.shape[0]
        idx = F.pad(batch.idx, (0, max(n, MIN_SIZE) - n))
        positions = F.pad(batch.positions, (0, max(n, MIN_SIZE) - n))
        logit_rows = F.pad(batch.logit_rows, (0, max(S, MIN_SIZE) - S))
        ForwardContext.batch = batch
        try:
            logits, _ = compiled(idx, batch=GraphBatch(positions, logit_rows))
        finally:
            ForwardContext.batch = None
        return logits[:S]

    return forward


def keep_gelu_apart():
    """Stop inductor from folding GELU into the oneDNN linear before it as a post-op, so that GELU runs as
    inductor's own kernel instead. Inductor has no setting for this: its unary post-op patterns are registered
    by a private function, here replaced before anything compiles (the binary ones, the residual adds, stay)."""
    from torch._inductor.fx_passes import mkldnn_fusion

    if not hasattr(mkldnn_fusion, "_register_unary_fusion"):
        sys.exit("error: --gelu-postop off needs inductor's mkldnn_fusion._register_unary_fusion (torch 2.13)")
    mkldnn_fusion._register_unary_fusion = lambda: None


class StepCount(Observer):
    steps = 0

    def stepped(self):
        self.steps += 1


def serve(model, forward, prompts, new_tokens, counter=None):
    """-> (output tok/s, outputs), one PagedEngine with vLLM's step budget; forward replaces the model's call."""
    num_blocks = sum(blocks_for(len(p) + new_tokens, 16) for p in prompts)
    engine = ServingEngine(model, num_blocks=num_blocks, token_budget=4096, vocab_size=50257)
    if counter is not None:
        engine.observers.append(counter)
    if forward is not None:
        engine.model = lambda idx, batch: (forward(batch), None)
    requests = [Request(p, new_tokens) for p in prompts]
    start = time.perf_counter()
    engine.run(requests)
    return len(prompts) * new_tokens / (time.perf_counter() - start), [r.generated for r in requests]


SEPARATE_PASSES = ("aten::gelu", "aten::native_layer_norm")


def profile(model, forward, prompts, new_tokens, top=8):
    """Print one run's heaviest ops by self CPU time, per step, and its separate GELU and layer-norm passes."""
    counter = StepCount()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        serve(model, forward, prompts, new_tokens, counter)
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events)
    for e in events[:top]:
        print(
            f"      {e.key[:60]:<60} {e.count / counter.steps:6.1f} calls, {e.self_cpu_time_total / 1e3 / counter.steps:7.2f} ms"
            f" a step ({100 * e.self_cpu_time_total / total:.0f}%)"
        )
    passes = {e.key: e.count / counter.steps for e in events if e.key in SEPARATE_PASSES}
    print("      separate passes a step: " + ", ".join(f"{k} {passes.get(k, 0):.0f}" for k in SEPARATE_PASSES))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="tiny/decode,tiny/mixed,gpt2/decode")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="profile one run of each variant after the timed runs")
    p.add_argument(
        "--gelu-postop",
        default="on",
        choices=["on", "off"],
        help="on: inductor's default, GELU as a post-op of the oneDNN linear before it; off: GELU as inductor's own "
        "kernel instead (bench/linear_postops.py times the two)",
    )
    args = p.parse_args()
    torch._inductor.config.freezing = True
    if args.gelu_postop == "off":
        keep_gelu_apart()
    torch._inductor.config.cpp.enable_kernel_profile = args.profile
    dtype = getattr(torch, args.dtype)
    flags = (" --profile" if args.profile else "") + f" --gelu-postop {args.gelu_postop}"
    print(
        f"$ python bench/compile_graph.py --workloads {args.workloads} --dtype {args.dtype} --repeats {args.repeats}{flags}"
    )
    print(f"{cpu_line()}; torch {torch.__version__}, {torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d')}")
    for name in args.workloads.split(","):
        shape, key, _, _ = parse(name)
        timed, warm, new_tokens = prompts_for(key, 1), prompts_for(key, 2), WORKLOADS[key][2]
        eager_model = load_checkpoint(export(shape)).to(dtype)
        prepack(eager_model)
        graph_model = load_checkpoint(export(shape)).to(dtype)
        variants = {"eager": (eager_model, None), "graph": (graph_model, graph_forward(graph_model))}
        warm_s = {}
        for label, (model, forward) in variants.items():
            start = time.perf_counter()
            serve(model, forward, warm, min(new_tokens, 8))
            warm_s[label] = time.perf_counter() - start
        graphs_warm = counters["stats"]["unique_graphs"]
        speeds, outputs = {label: [] for label in variants}, {}
        for repeat in range(args.repeats):
            for label in list(variants)[:: 1 if repeat % 2 == 0 else -1]:
                tok_s, outputs[label] = serve(*variants[label], timed, new_tokens)
                speeds[label].append(tok_s)
        ratios = [g / e for g, e in zip(speeds["graph"], speeds["eager"])]
        same = sum(a == b for a, b in zip(outputs["graph"], outputs["eager"]))
        print(
            f"--- {name} ({args.dtype}), {len(timed)} prompts, {new_tokens} new, greedy; output tok/s, median (min-max)"
        )
        for label in variants:
            print(f"  {label:<6} {fmt(speeds[label])}  (warm-up {warm_s[label]:.1f} s)")
        print(
            f"  graph / eager: {fmt(ratios, 'x')} per repeat; equal outputs {same}/{len(timed)}; graphs compiled "
            f"{graphs_warm} after warm-up, {counters['stats']['unique_graphs']} after the timed runs",
            flush=True,
        )
        for label in variants if args.profile else ():
            print(f"  profile, {label}: the heaviest ops by self CPU time")
            profile(*variants[label], timed, new_tokens)


if __name__ == "__main__":
    main()
