"""The whole step's forward compiled on the CPU, against the engine as it runs (eager around prepacked
oneDNN GEMMs and the compiled decode attention), on bench/vllm_compare.py's workloads and weights.

    python bench/compile_step.py [--workloads tiny/decode,tiny/mixed,gpt2/prefill] [--repeats 3]

"Compiled" is torch.compile(model.forward, dynamic=True) with inductor's freezing (weights constant,
prepacked by inductor for oneDNN, layer norms, GELU and residual adds fused around them). Each step's
attention (StepBatch.attend: a Python loop over the step's chunks) stays outside the graphs, behind
torch.compiler.disable, so the forward splits into graphs at every layer's attention call, each dynamic
in the step's token count; dynamo's recompile limit is raised so that no layer falls back to eager. The
graph count is printed after the warm-up and after the timed runs: a rise means recompiles. Both variants
warm up on other prompts (the compile is timed), then alternate in one process, greedy; the ratio is
taken per repeat, and the last repeat's outputs are compared token for token.
"""

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch._inductor.config

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import batch
from bench.vllm_compare import WORKLOADS, export, prompts_for
from ext import ServingEngine
from harness.checkpoints import load_checkpoint
from harness.tuning import prepack
from paged import blocks_for
from sequence import Request


def serve(model, forward, prompts, new_tokens):
    """-> (output tok/s, outputs), one PagedEngine with its defaults; forward replaces the model's call."""
    if forward is None:  # eager: the linears prepacked, as generate.py loads a model; the compiled graph packs its own
        prepack(model)
    engine = ServingEngine(
        model, num_blocks=sum(blocks_for(len(p) + new_tokens, 16) for p in prompts), vocab_size=50257
    )
    if forward is not None:
        engine.model = forward
    requests = [Request(p, new_tokens) for p in prompts]
    start = time.perf_counter()
    engine.run(requests)
    return len(prompts) * new_tokens / (time.perf_counter() - start), [r.generated for r in requests]


def fmt(xs, unit=""):
    return f"{statistics.median(xs):,.2f}{unit} ({min(xs):,.2f}-{max(xs):,.2f})"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="tiny/decode,tiny/mixed,gpt2/prefill")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch._inductor.config.freezing = True
    torch._dynamo.config.recompile_limit = 64
    batch.StepBatch.attend = torch.compiler.disable(batch.StepBatch.attend)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d')}")
    for name in args.workloads.split(","):
        shape, workload = name.split("/")
        workload = name if name in WORKLOADS else workload
        timed, warm, new_tokens = prompts_for(workload, 1), prompts_for(workload, 2), WORKLOADS[workload][2]
        eager_model = load_checkpoint(export(shape))
        compiled_model = copy.deepcopy(eager_model)
        variants = {
            "eager": (eager_model, None),
            "compiled": (compiled_model, torch.compile(compiled_model.forward, dynamic=True)),
        }
        torch._dynamo.reset()
        graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        for label, (model, forward) in variants.items():
            start = time.perf_counter()
            serve(model, forward, warm, min(new_tokens, 8))
            print(f"{name}: {label} warm-up {time.perf_counter() - start:.1f} s")
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before
        speeds, outputs = {label: [] for label in variants}, {}
        for _ in range(args.repeats):
            for label, (model, forward) in variants.items():
                tok_s, outputs[label] = serve(model, forward, timed, new_tokens)
                speeds[label].append(tok_s)
        graphs_after = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before
        ratios = [c / e for e, c in zip(speeds["eager"], speeds["compiled"])]
        same = sum(a == b for a, b in zip(outputs["eager"], outputs["compiled"]))
        print(
            f"{name}: eager {fmt(speeds['eager'], ' tok/s')}, compiled {fmt(speeds['compiled'], ' tok/s')}, "
            f"compiled / eager per repeat {fmt(ratios, 'x')}; equal outputs {same}/{len(timed)}; "
            f"graphs after warm-up {graphs}, after the timed runs {graphs_after}",
            flush=True,
        )


if __name__ == "__main__":
    main()
