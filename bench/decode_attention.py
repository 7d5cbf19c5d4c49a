"""Decode attention against the machine's read bandwidth, at GPT-2 small's heads (12 x 64), one layer: a
batch of one-token rows, each over its own context in a pool of 16-token blocks, read three ways.

    python bench/decode_attention.py [--dtype float32] [--batch 64] [--contexts 144,528,1040] [--rounds 7]

  compiled   the engine's path: torch.compile(gather_attend), which reads K/V straight from the pool and
             sums the values within each block first;
  flat       the same as it was before: the values summed over all of a row's keys at once;
  eager      the engine's eager path: gather whole blocks (a copy), then SDPA.

Each context is run twice: every row at the same length (decode: all sequences started together), and rows
spread evenly over half the length to the whole (mixed: the batch's table is as wide as its longest row, so
shorter rows carry padding blocks). Bytes are each row's K and V over the keys it needs, once (the query and
the output are noise beside them); GB/s is those bytes over the median call (of --rounds rounds of 20
calls); the share is that against the read bandwidth of a float32 sum over 256 MB at the same thread count
(bench/vllm_compare.py's read_bandwidth). Outputs are compared with the compiled path's before timing.
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from batch import attend
from bench.vllm_compare import cpu_line, read_bandwidth
from paged import blocks_for, gather_attend, gather_kv

BLOCK_SIZE = 16
HEADS = 12
HEAD_SIZE = 64


def flat_gather_attend(q, k_pool, v_pool, block_table, kv_len):
    """gather_attend as it was: the values summed over all of a row's keys at once. Inductor's kernel then
    walks the keys innermost for each head's 8-float slice, so a row's values are fetched once per slice."""
    B, H, D = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    keys = k_pool[block_table].to(acc)  # (B, W, block_size, H, D)
    scores = (q[:, None, None].to(acc) * keys).sum(-1).view(B, -1, H) * D**-0.5  # (B, L, H)
    visible = torch.arange(scores.shape[1], device=q.device) < kv_len[:, None]  # (B, L)
    p = scores.masked_fill(~visible[..., None], float("-inf")).softmax(1)
    values = v_pool[block_table].to(acc).view(B, -1, H, D)
    return (p[..., None] * values).sum(1).to(q.dtype)


def eager_attend(q, k_pool, v_pool, block_table, kv_len):
    k = gather_kv(k_pool, block_table)  # (B, L, H, D)
    v = gather_kv(v_pool, block_table)
    return attend(q[:, None], k, v, kv_len[:, None] - 1)[:, 0]


def compiled(fn):
    graph = torch.compile(fn)

    def call(q, k_pool, v_pool, table, kv_len):
        for t in (q, table, kv_len, k_pool, v_pool):  # as the engine marks them: one graph for every shape
            torch._dynamo.maybe_mark_dynamic(t, 0)
        torch._dynamo.maybe_mark_dynamic(table, 1)
        return graph(q, k_pool, v_pool, table, kv_len)

    return call


def case(batch, context, spread, dtype):
    """-> q, k_pool, v_pool, table (B, W), kv_len (B,): each row's blocks scattered over a shuffled pool."""
    g = torch.Generator().manual_seed(context + spread)
    lengths = torch.linspace(context // 2 if spread else context, context, batch).long()
    widths = blocks_for(lengths, BLOCK_SIZE)
    num_blocks = int(widths.sum())
    order = torch.randperm(num_blocks, generator=g)
    table = torch.full((batch, int(widths.max())), num_blocks)  # the padding block, as the engine pads
    start = 0
    for row, width in enumerate(widths.tolist()):
        table[row, :width] = order[start : start + width]
        start += width
    shape = (num_blocks + 1, BLOCK_SIZE, HEADS, HEAD_SIZE)
    k_pool, v_pool = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
    q = torch.randn(batch, HEADS, HEAD_SIZE, generator=g).to(dtype)
    return q, k_pool, v_pool, table, lengths


def median_call(fn, args, rounds, calls=20):
    seconds = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        seconds.append((time.perf_counter() - start) / calls)
    return statistics.median(seconds)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--contexts", default="144,528,1040")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    bandwidth, threads = read_bandwidth()
    print(
        f"$ python bench/decode_attention.py --dtype {args.dtype} --batch {args.batch} --contexts {args.contexts} "
        f"--rounds {args.rounds}"
    )
    print(f"{cpu_line()}; torch {torch.__version__}, {threads} threads, {time.strftime('%Y-%m-%d')}")
    print(f"read bandwidth: {bandwidth:.1f} GB/s (a float32 sum over 256 MB, median of 7)")
    paths = {"compiled": compiled(gather_attend), "flat": compiled(flat_gather_attend), "eager": eager_attend}
    for context in map(int, args.contexts.split(",")):
        for spread in (False, True):
            inputs = case(args.batch, context, spread, dtype)
            needed = int(inputs[4].sum()) * 2 * HEADS * HEAD_SIZE * dtype.itemsize
            reference = paths["compiled"](*inputs)
            label = f"{args.batch} rows, {'half to all of ' if spread else ''}{context} keys"
            print(f"--- {label}: {needed / 1e6:,.1f} MB of K/V needed; median of {args.rounds} rounds of 20 calls")
            for name, fn in paths.items():
                torch.testing.assert_close(fn(*inputs), reference, atol=2e-2, rtol=2e-2)
                seconds = median_call(fn, inputs, args.rounds)
                rate = needed / seconds / 1e9
                print(
                    f"  {name:<9} {seconds * 1e3:7.3f} ms  {rate:6.1f} GB/s  {100 * rate / bandwidth:4.0f}% of the read bandwidth"
                )


if __name__ == "__main__":
    main()
