"""Decode attention against the machine's read bandwidth, at GPT-2 small's heads (12 x 64), one layer: a
batch of one-token rows, each over its own context in a pool of 16-token blocks, read six ways.

    python bench/decode_attention.py [--dtype float32] [--batch 64] [--contexts 144,528,1040] [--rounds 7]
                                     [--shortest 0.5]

  compiled   the engine's path: torch.compile(gather_attend), which reads K/V straight from the pool and
             sums the values within each block first;
  ragged     not in the engine: each row's real blocks only, as pairs (block, row), each block reduced on
             its own, then each row's blocks combined; its tables are built on the host, timed apart;
  flat       not in the engine: the values summed over all of a row's keys at once;
  eager      the engine's eager path: gather whole blocks (a copy), then SDPA;
  kernel     --compile kernel's path (ext/cpu_kernel.py): a C kernel that walks each row's block table, one
             row per thread at a time;
  flex       not in the engine: bench/gpu.py's flex_attention candidate, compiled, the block table as its
             block mask (built once a step, timed apart); inductor's CPU template takes it with a 4-D query
             and a mask as wide as the pool (it refuses one narrower than the keys).

Each context is run twice: every row at the same length (decode: all sequences started together), and rows
spread evenly from --shortest (a share, half by default) of the length to the whole (mixed: the batch's table
is as wide as its longest row, so shorter rows carry padding blocks). Bytes are each row's K and V over the
keys it needs, once (the query and the output are noise beside them); GB/s is those bytes over the median call
(of --rounds rounds of 20 calls); the share is that against the read bandwidth of a float32 sum over 256 MB at
the same thread count (bench/vllm_compare.py's read_bandwidth). Outputs are compared with the compiled path's
before timing.
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench.gpu import flex_block_mask
from bench.vllm_compare import cpu_line, read_bandwidth
from ext.cpu_kernel import kernel_attend
from model import attend, visible_keys
from paged import blocks_for, gather_attend, gather_kv

BLOCK_SIZE = 16
HEADS = 12
HEAD_SIZE = 64


def flat_gather_attend(q, k_pool, v_pool, block_table, kv_len):
    """gather_attend with the values summed over all of a row's keys at once, not block by block first.
    Inductor's kernel then walks the keys innermost for each head's 8-float slice, so a row's values are fetched
    once per slice."""
    B, H, D = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    keys = k_pool[block_table].to(acc)  # (B, W, block_size, H, D)
    scores = (q[:, None, None].to(acc) * keys).sum(-1).view(B, -1, H) * D**-0.5  # (B, L, H)
    visible = torch.arange(scores.shape[1], device=q.device) < kv_len[:, None]  # (B, L)
    p = scores.masked_fill(~visible[..., None], float("-inf")).softmax(1)
    values = v_pool[block_table].to(acc).view(B, -1, H, D)
    return (p[..., None] * values).sum(1).to(q.dtype)


def ragged_tables(block_table, kv_len):
    """The padded (B, W) table as pairs, one per block a row really reads: pair_block, pair_row, pair_len
    (P,) the block, its row and its visible keys; pair_of (B, W) each row's pairs, padded with P. Host work,
    once a step for every layer: timed apart."""
    B, W = block_table.shape
    real = torch.arange(W) < blocks_for(kv_len, BLOCK_SIZE)[:, None]  # (B, W)
    num_pairs = int(real.sum())
    pair_of = torch.full((B, W), num_pairs)
    pair_of[real] = torch.arange(num_pairs)
    pair_len = (kv_len[:, None] - torch.arange(W) * BLOCK_SIZE).clamp(max=BLOCK_SIZE)[real]
    return block_table[real], real.nonzero()[:, 0], pair_len, pair_of


def ragged_gather_attend(q, k_pool, v_pool, pair_block, pair_row, pair_len, pair_of):
    """Each row's real blocks only, so that no row computes the padding up to the batch's longest: each block
    reduced on its own (its max, sum and weighted values, P of each), then each row combines its blocks'."""
    D = q.shape[-1]
    acc = torch.promote_types(q.dtype, torch.float32)
    keys = k_pool[pair_block].to(acc)  # (P, block_size, H, D)
    scores = (q[pair_row, None].to(acc) * keys).sum(-1) * D**-0.5  # (P, block_size, H)
    visible = torch.arange(keys.shape[1], device=q.device) < pair_len[:, None]  # (P, block_size)
    scores = scores.masked_fill(~visible[..., None], float("-inf"))
    block_max = scores.amax(1)  # (P, H)
    p = (scores - block_max[:, None]).exp()
    block_out = (p[..., None] * v_pool[pair_block].to(acc)).sum(1)  # (P, H, D)
    block_max = F.pad(block_max, (0, 0, 0, 1), value=float("-inf"))[pair_of]  # (B, W, H), padding at -inf
    weight = (block_max - block_max.amax(1, keepdim=True)).exp()
    out = (weight[..., None] * F.pad(block_out, (0, 0, 0, 0, 0, 1))[pair_of]).sum(1)  # (B, H, D)
    total = (weight * F.pad(p.sum(1), (0, 0, 0, 1))[pair_of]).sum(1)  # (B, H)
    return (out / total[..., None]).to(q.dtype)


def eager_attend(q, k_pool, v_pool, block_table, kv_len):
    k = gather_kv(k_pool, block_table)  # (B, L, H, D)
    v = gather_kv(v_pool, block_table)
    return attend(q[:, None], k, v, visible_keys(k, kv_len[:, None] - 1))[:, 0]


def flex_inputs(q, k_pool, v_pool, table, kv_len):
    """bench/gpu.py's flex candidate's arguments, in the form inductor's CPU template takes: a 4-D query buffer,
    and the block mask widened to the pool's blocks. Host and tensor work, once a step for every layer."""
    mask = flex_block_mask(table, kv_len, len(k_pool), BLOCK_SIZE)
    mask = BlockMask.from_kv_blocks(
        mask.kv_num_blocks,
        F.pad(mask.kv_indices, (0, len(k_pool) - mask.kv_indices.shape[-1])),
        BLOCK_SIZE=mask.BLOCK_SIZE,
        mask_mod=mask.mask_mod,
        seq_lengths=mask.seq_lengths,
        compute_q_blocks=False,
    )
    return q[:, :, None].contiguous(), k_pool, v_pool, mask


def flex_attend(q, k_pool, v_pool, block_mask):
    """q (B, H, 1, D) -> (B, H, D), through flex_attention over the pool read in place."""
    k, v = (pool.flatten(0, 1).transpose(0, 1)[None] for pool in (k_pool, v_pool))  # (1, H, slots, D)
    return flex_attention(q, k, v, block_mask=block_mask)[:, :, 0]


def compiled(fn):
    """torch.compile(fn), called with q, the pools and fn's tables (a block table or pairs)."""
    graph = torch.compile(fn)

    def call(q, k_pool, v_pool, *tables):
        for t in (q, k_pool, v_pool, *tables):  # as the engine marks them: one graph for every shape
            torch._dynamo.maybe_mark_dynamic(t, 0)
        for table in (t for t in tables if t.dim() == 2):  # a (B, W) table's width too
            torch._dynamo.maybe_mark_dynamic(table, 1)
        return graph(q, k_pool, v_pool, *tables)

    return call


def case(batch, context, spread, dtype, shortest=0.5):
    """-> q, k_pool, v_pool, table (B, W), kv_len (B,): each row's blocks scattered over a shuffled pool."""
    g = torch.Generator().manual_seed(context + spread)
    lengths = torch.linspace(int(context * shortest) if spread else context, context, batch).long()
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
    p.add_argument("--shortest", type=float, default=0.5, help="spread rows: the shortest, as a share of the context")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    bandwidth, threads = read_bandwidth()
    print(
        f"$ python bench/decode_attention.py --dtype {args.dtype} --batch {args.batch} --contexts {args.contexts} "
        f"--rounds {args.rounds} --shortest {args.shortest}"
    )
    print(f"{cpu_line()}; torch {torch.__version__}, {threads} threads, {time.strftime('%Y-%m-%d')}")
    print(f"read bandwidth: {bandwidth:.1f} GB/s (a float32 sum over 256 MB, median of 7)")
    paths = {"compiled": compiled(gather_attend), "ragged": compiled(ragged_gather_attend)}
    paths.update(flat=compiled(flat_gather_attend), eager=eager_attend, kernel=kernel_attend)
    torch._dynamo.config.recompile_limit = 64  # flex compiles each case's shapes: its decoding kernel wants them static
    paths["flex"] = torch.compile(flex_attend, dynamic=False)
    for context in map(int, args.contexts.split(",")):
        for spread in (False, True):
            inputs = case(args.batch, context, spread, dtype, args.shortest)
            needed = int(inputs[4].sum()) * 2 * HEADS * HEAD_SIZE * dtype.itemsize
            reference = paths["compiled"](*inputs)
            tables = ragged_tables(*inputs[3:])
            host = median_call(ragged_tables, inputs[3:], args.rounds)
            flex_args = flex_inputs(*inputs)
            flex_host = median_call(flex_inputs, inputs, args.rounds)
            shortest = f"{int(context * args.shortest)} to " if spread else ""
            label = f"{args.batch} rows, {shortest}{context} keys"
            print(
                f"--- {label}: {needed / 1e6:,.1f} MB of K/V needed; median of {args.rounds} rounds of 20 calls; "
                f"ragged's tables on the host {host * 1e3:.3f} ms, flex's mask {flex_host * 1e3:.3f} ms, once a step "
                "for every layer"
            )
            for name, fn in paths.items():
                args_in = dict(ragged=(*inputs[:3], *tables), flex=flex_args).get(name, inputs)
                torch.testing.assert_close(fn(*args_in), reference, atol=2e-2, rtol=2e-2)
                seconds = median_call(fn, args_in, args.rounds)
                rate = needed / seconds / 1e9
                print(
                    f"  {name:<9} {seconds * 1e3:7.3f} ms  {rate:6.1f} GB/s  "
                    f"{100 * rate / bandwidth:4.0f}% of the read bandwidth"
                )


if __name__ == "__main__":
    main()
