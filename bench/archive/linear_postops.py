"""A oneDNN linear with its GELU or residual add as a post-op, against the same linear followed by the op on
its own, at GPT-2 small's MLP shapes: what inductor's freezing chooses for a compiled step (it folds the
GELU after c_fc and the residual add after c_proj into the linear), timed on this CPU.

    python bench/linear_postops.py [--dtype float32] [--rows 32,64,512,4096] [--rounds 7]

Both sides multiply by the same weight, prepacked once for oneDNN (model.prepack's call); "apart" runs the
engine's eager path: the packed linear, then F.gelu or the add. Outputs are compared before timing. Each
round times both sides, interleaved; the table gives the median of --rounds rounds, each the mean of 10 calls.
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from bench.vllm_compare import cpu_line

N_EMBD = 768  # GPT-2 small


def seconds(fn, calls=10):
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def sides_for(x, h, residual, fc_packed, fc_bias, proj_packed, proj_bias):
    """-> {side: a call}: x (N, C) through c_fc and GELU, h (N, 4C) through c_proj plus the residual (N, C),
    each apart (the engine's eager path) and as one oneDNN call with the op as its post-op (inductor's)."""
    linear = torch.ops.mkldnn._linear_pointwise
    return {
        "gelu apart": lambda: F.gelu(linear(x, fc_packed, fc_bias, "none", [], "")),
        "gelu post-op": lambda: linear(x, fc_packed, fc_bias, "gelu", [-1], "none"),
        "add apart": lambda: linear(h, proj_packed, proj_bias, "none", [], "") + residual,
        "add post-op": lambda: linear.binary(h, residual, proj_packed, proj_bias, "add"),
    }


def measure(sides, rounds):
    """-> {side: median ms}, the sides interleaved in each round."""
    times = {name: [] for name in sides}
    for fn in sides.values():
        fn()
    for _ in range(rounds):
        for name, fn in sides.items():
            times[name].append(seconds(fn))
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rows", default="32,64,512,4096", help="the step's token counts")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        sys.exit("error: oneDNN has no bf16 kernels on this CPU (it needs AVX512-BF16 or AMX): nothing to time")
    print(f"$ python bench/linear_postops.py --dtype {args.dtype} --rows {args.rows} --rounds {args.rounds}")
    print(f"{cpu_line()}; torch {torch.__version__}, {torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d')}")
    print(
        "rows  c_fc + GELU: apart, post-op, post-op / apart    c_proj + residual add: apart, post-op, post-op / apart"
    )
    torch.manual_seed(0)
    fc_weight = (torch.randn(4 * N_EMBD, N_EMBD) * 0.02).to(dtype)
    proj_weight = (torch.randn(N_EMBD, 4 * N_EMBD) * 0.02).to(dtype)
    fc_bias = torch.randn(4 * N_EMBD).to(dtype)
    proj_bias = torch.randn(N_EMBD).to(dtype)
    fc_packed = torch.ops.mkldnn._reorder_linear_weight(fc_weight, None)
    proj_packed = torch.ops.mkldnn._reorder_linear_weight(proj_weight, None)
    for rows in map(int, args.rows.split(",")):
        x = torch.randn(rows, N_EMBD).to(dtype)
        h = torch.randn(rows, 4 * N_EMBD).to(dtype)
        residual = torch.randn(rows, N_EMBD).to(dtype)
        sides = sides_for(x, h, residual, fc_packed, fc_bias, proj_packed, proj_bias)
        tolerance = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(sides["gelu post-op"](), sides["gelu apart"](), rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(sides["add post-op"](), sides["add apart"](), rtol=tolerance, atol=tolerance)
        ms = measure(sides, args.rounds)
        gelu = ms["gelu post-op"] / ms["gelu apart"]
        add = ms["add post-op"] / ms["add apart"]
        print(
            f"{rows:>5}  {ms['gelu apart']:8.3f} ms {ms['gelu post-op']:8.3f} ms {gelu:6.2f}x"
            f"          {ms['add apart']:8.3f} ms {ms['add post-op']:8.3f} ms {add:6.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
