"""From what weight size does a linear run faster on oneDNN's prepacked copy than through F.linear, in float32?
prepack() packs a float32 weight only from 2**17 elements (ext/tuning.py): this measures where that comes from.

    python bench/prepack_size.py

One Linear (in_features K, out_features N) on M rows, eager and packed, the mean of 300 calls after 20, in one
process with torch's thread count, plain then packed.
"""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from harness.tuning import PackedLinear, prepack


def mean_us(f, x, n=300):
    for _ in range(20):
        f(x)
    start = time.perf_counter()
    for _ in range(n):
        f(x)
    return (time.perf_counter() - start) / n * 1e6


@torch.no_grad()
def main():
    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    print(f"$ python bench/prepack_size.py\n{cpu}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{time.strftime('%Y-%m-%d')}")  # fmt: skip
    print(f"{'K':>5} {'N':>6} {'weights':>9} {'M':>4} {'F.linear us':>12} {'packed us':>10} {'packed / plain':>15}")
    for K, N in [(32, 96), (32, 128), (64, 256), (128, 384), (128, 512), (256, 768), (768, 256), (768, 2304),
                 (128, 50304), (768, 50304)]:  # fmt: skip
        for M in (16, 256):
            plain, packed = torch.nn.Linear(K, N).eval(), PackedLinear(K, N).eval()
            packed.load_state_dict(plain.state_dict())
            packed.pack(torch.float32)
            x = torch.randn(M, K)
            a, b = mean_us(plain, x), mean_us(packed, x)
            print(f"{K:>5} {N:>6} {K * N:>9,} {M:>4} {a:>12.1f} {b:>10.1f} {b / a:>14.2f}x")
    assert prepack  # the function whose threshold this measures


if __name__ == "__main__":
    main()
