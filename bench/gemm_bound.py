"""How close each engine runs to its bound: the CPU's throughput on one large GEMM and its read bandwidth,
and for each workload of a bench/vllm_compare.py table, the time its linear layers alone would take at that
rate, the time its least reads would take at that bandwidth, and the larger of the two (the bound: a step
can beat neither) as a share of the time each engine took. Run it on the machine that made the table.

    python bench/vllm_compare.py --dtype bfloat16 > out/vllm_bf16.txt
    python bench/gemm_bound.py out/vllm_bf16.txt

A workload's GEMM work: every prompt token and every fed-back new token goes through each layer's four
linears (12 n_embd^2 weights), and every new token's logits through the lm_head (n_embd x 50,257); 2 FLOPs
per weight. Attention, layer norms and sampling are left out: the share is how much of a step is GEMMs
at the rate a large, well-shaped GEMM reaches, so 100% is out of reach and the rest is everything else.
A workload's least reads: every step reads every weight once (prefill in steps of vLLM's 4,096 tokens,
then one step per new token), and every decode step the K/V of every sequence's context so far.
"""

import argparse
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vllm_compare import SHAPES, WORKLOADS, parse, prompts_for, read_bandwidth


def mm_gflops(dtype, n=4096, repeats=5):
    """The best of: a plain torch.mm, and the engine's own GEMM (a weight prepacked for oneDNN), n x n x n.
    On an AMD CPU torch.mm's float32 path (MKL) runs well below oneDNN's, so the engine's own call is the
    fairer ceiling there."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from harness.tuning import prepack

    a, model = torch.randn(n, n, dtype=dtype), torch.nn.Sequential(torch.nn.Linear(n, n, bias=False)).to(dtype).eval()
    prepack(model)
    linear = model[0]
    best = 0
    fns = {"torch.mm": lambda: torch.mm(a, a), "a prepacked oneDNN linear": lambda: linear(a)}
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        # without bf16 instructions torch.mm emulates bf16 (minutes a call); the engine's linears do not
        del fns["torch.mm"]
    for fn in fns.values():
        with torch.no_grad():
            fn()
            best = max(best, 2 * n**3 / min(timed(fn) for _ in range(repeats)) / 1e9)
    return best, " and ".join(fns)


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def gemm_flops(name):
    shape, key, _, _ = parse(name)
    n_layer, _, n_embd = SHAPES[shape]
    _, _, new = WORKLOADS[key]
    prompts = prompts_for(key, 1)
    body_tokens = sum(len(p) + new - 1 for p in prompts)
    return 2 * (12 * n_embd**2 * n_layer * body_tokens + n_embd * 50257 * new * len(prompts)), new * len(prompts)


def bytes_read(name, element_size):
    """A greedy workload's least bytes read: the weights once per step, and the K/V of each decode step."""
    shape, key, _, _ = parse(name)
    n_layer, _, n_embd = SHAPES[shape]
    _, _, new = WORKLOADS[key]
    prompts = prompts_for(key, 1)
    weights = (12 * n_embd**2 * n_layer + n_embd * 50257) * element_size
    steps = -(-sum(len(p) for p in prompts) // 4096) + new - 1
    kv_tokens = sum(len(p) + t for p in prompts for t in range(1, new))  # keys read by decode steps
    return steps * weights + kv_tokens * 2 * n_layer * n_embd * element_size


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("table", help="the output of bench/vllm_compare.py (greedy workloads)")
    args = p.parse_args()
    with open(args.table) as f:
        text = f.read()
    dtype = re.search(r"--dtype (\w+)", text).group(1)
    rate, timed_gemms = mm_gflops(getattr(torch, dtype))
    bandwidth, threads = read_bandwidth()
    print(f"the fastest of {timed_gemms}, 4096^3 in {dtype}: {rate:,.0f} GFLOP/s, {threads} threads; from {args.table}")
    print(f"read bandwidth: {bandwidth:.1f} GB/s (a float32 sum over 256 MB, {threads} threads, median of 7)")
    for block in re.split(r"^--- ", text, flags=re.MULTILINE)[1:]:
        name = block.split()[0]
        if parse(name)[2:] != (1, 1):  # greedy workloads only: beams and samples do other work per token
            continue
        flops, tokens = gemm_flops(name)
        gemm_s = flops / rate / 1e9
        read = bytes_read(name, getattr(torch, dtype).itemsize)
        memory_s = read / bandwidth / 1e9
        bound_s = max(gemm_s, memory_s)
        shares = []
        for engine, speed in re.findall(r"^  (ours|vllm \w+)\s+([\d,.]+) \(", block, flags=re.MULTILINE):
            seconds = tokens / float(speed.replace(",", ""))
            shares.append(
                f"{engine} {seconds:.2f} s: GEMMs {100 * gemm_s / seconds:.0f}%, bound {100 * bound_s / seconds:.0f}%"
            )
        print(
            f"  {name}: {flops / 1e9:,.0f} GFLOP of GEMMs, {gemm_s:.2f} s at that rate; {read / 1e9:,.1f} GB read, "
            f"{memory_s:.2f} s at that bandwidth; bound {bound_s:.2f} s; " + "; ".join(shares)
        )


if __name__ == "__main__":
    main()
