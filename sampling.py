"""How the engine picks each next token from its logits: greedy rows take the argmax, sampled rows draw from a
hash of (seed, position) on the logits' device, with no generator state and no host sync."""

import torch

UINT32 = 0xFFFFFFFF


def mix32(x):
    """A 32-bit integer hash (hash-prospector's lowbias32, second constants) in int64 tensor ops: both
    multipliers are below 2**31, so no product of a 32-bit x overflows, on any device."""
    x = ((x ^ (x >> 16)) * 0x21F0AAAD) & UINT32
    x = ((x ^ (x >> 15)) * 0x735A2D97) & UINT32
    return x ^ (x >> 15)


def uniform(seed, position):
    """seed, position: (R,) int64 -> (R,) floats in [0, 1), a hash of (seed, position): a sequence's draw at
    position p is the same whatever runs beside it or ran before."""
    x = mix32((mix32(seed & UINT32) + position) & UINT32)
    return (x >> 8).float() / (1 << 24)  # 24 bits, each value exact in float32


def argmax(logits):
    """logits: (R, V) float32 or float64, as the engine samples them (numpy has no bf16) -> (R,) token ids."""
    # NOTE: on a CPU numpy's argmax is several times faster than torch's (docs/floor_and_sampling.md)
    if logits.device.type == "cpu":
        return torch.from_numpy(logits.numpy().argmax(-1))
    return logits.argmax(-1)


def invert_cdf(candidates, temperature, u):
    """candidates (R, C), temperature, u: (R,) -> (R, 1): the column whose softmax CDF first passes u."""
    # the max is subtracted before dividing, so a tiny temperature tends to greedy instead of overflowing
    shifted = candidates - candidates.max(-1, keepdim=True).values
    cdf = (shifted / temperature[:, None]).softmax(-1).cumsum(-1)
    # the cumsum ends at 1 only up to rounding: u is scaled to its real end, and the clamp catches a u rounded onto it
    column = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
    return column.clamp(max=cdf.size(1) - 1)


def sample(logits, temperature, top_k, seed, position, max_top_k=0, uncut=True):
    """logits (R, V); temperature, top_k (0: keep every id), seed, position: (R,) -> (R,) token ids. Greedy
    rows (temperature 0) take the argmax; the others sample at uniform(seed, position) among their own top_k
    best, sorted, or every id. max_top_k: the largest top_k of a sampled row (0: none cuts); uncut: whether
    some sampled row keeps every id."""
    tokens = argmax(logits)
    if not uncut and not max_top_k:  # every row greedy
        return tokens
    sampled = temperature > 0
    temperature = torch.where(sampled, temperature, 1.0)
    u = uniform(seed, position)
    if uncut:
        drawn = invert_cdf(logits.float(), temperature, u)[:, 0]
        tokens = torch.where(sampled & (top_k == 0), drawn, tokens)
    if max_top_k:  # (R, K): the K best, sorted, so a row's own top_k is a prefix
        values, ids = logits.float().topk(max_top_k)
        beyond_top_k = torch.arange(max_top_k, device=logits.device) >= top_k[:, None]
        values = values.masked_fill(beyond_top_k, float("-inf"))
        drawn = ids.gather(1, invert_cdf(values, temperature, u))[:, 0]
        tokens = torch.where(sampled & (top_k > 0), drawn, tokens)
    return tokens
