"""Prefill attention on the CPU: the engine's SDPA calls against the two alternatives below.

    python bench/prefill_attention.py [--repeats 3]

1. flex_attention (compiled, static shapes) with a causal block mask against SDPA, on K/V that are already
   dense (so before any paging cost): a fresh 512-token chunk, and the last 88 tokens of a 600-token
   prompt after 512 cached ones, at the tiny shape's heads (4 x 32) and GPT-2 small's (12 x 64).
2. One step's prefill chunks attended one SDPA call each (as StepBatch.attend does) against one call
   over them all, padded to the longest with a mask: the call alone, and with the padding and unpadding.
Each time is the median of 10 calls after one warm-up call; variants alternate, and each figure is the
median (min-max) of --repeats such medians. Outputs are checked against SDPA's.
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


def ms(f, n=10):
    f()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def compare(name, variants, repeats):
    times = {label: [] for label in variants}
    for _ in range(repeats):
        for label, f in variants.items():
            times[label].append(ms(f))
    cells = [f"{label} {statistics.median(x):.2f} ({min(x):.2f}-{max(x):.2f}) ms" for label, x in times.items()]
    print(f"{name}: " + ", ".join(cells), flush=True)


def flex_case(flex, H, D, n, L, repeats):
    q, k, v = torch.randn(1, H, n, D), torch.randn(1, H, L, D), torch.randn(1, H, L, D)
    cached = L - n
    block_mask = create_block_mask(lambda b, h, i, j: j <= i + cached, 1, 1, n, L, device="cpu")
    visible = torch.arange(L) <= torch.arange(cached, L)[:, None]  # (n, L)

    def sdpa():
        if n == L:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible)

    def flex_call():
        return flex(q, k, v, block_mask=block_mask)

    assert torch.allclose(sdpa(), flex_call(), atol=1e-5)
    compare(f"{H} x {D}, {n} new tokens after {cached} cached", {"SDPA": sdpa, "flex_attention": flex_call}, repeats)


def packed_case(H, D, lens, repeats):
    qs, ks, vs = ([torch.randn(1, H, n, D) for n in lens] for _ in range(3))
    L = max(lens)
    i = torch.arange(L)
    mask = ((i[:, None] >= i) & (i < torch.tensor(lens)[:, None, None]))[:, None]  # (B, 1, L, L): causal, no padded key

    def separate():
        return [F.scaled_dot_product_attention(q, k, v, is_causal=True) for q, k, v in zip(qs, ks, vs)]

    def pad(chunks):
        return torch.cat([F.pad(x, (0, 0, 0, L - x.shape[2])) for x in chunks])  # (B, H, L, D)

    Q, K, V = pad(qs), pad(ks), pad(vs)

    def packed_call():
        return F.scaled_dot_product_attention(Q, K, V, attn_mask=mask)

    def packed():
        out = F.scaled_dot_product_attention(pad(qs), pad(ks), pad(vs), attn_mask=mask)
        return [out[b : b + 1, :, :n] for b, n in enumerate(lens)]

    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(separate(), packed()))
    variants = {"separate calls": separate, "one packed call": packed_call, "packed + pad/unpad": packed}
    compare(f"{H} x {D}, fresh chunks of {lens}", variants, repeats)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d')}")
    print("-- flex_attention with a causal block mask against SDPA")
    flex = torch.compile(flex_attention, dynamic=False)
    for H, D in [(4, 32), (12, 64)]:
        for n, L in [(512, 512), (88, 600)]:  # a fresh 512-token chunk; the rest of a 600-token prompt
            flex_case(flex, H, D, n, L, args.repeats)
    print("-- a step's fresh chunks: one SDPA call each against one padded call with a mask")
    for H, D in [(4, 32), (12, 64)]:
        for lens in [[128] * 4, [40, 90, 150, 200, 32]]:
            packed_case(H, D, lens, args.repeats)


if __name__ == "__main__":
    main()
