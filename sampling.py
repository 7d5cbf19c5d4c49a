"""How the engine picks each next token from its logits: greedy rows take the argmax, sampled rows draw from a
hash of (seed, position) on the logits' device, with no generator state and no host sync. A sampled row keeps
the ids its settings keep, in Hugging Face's order: temperature, then top-k, top-p and min-p."""

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
    x = mix32((mix32(seed) + position) & UINT32)  # seed: 32 bits, as the engine keeps it
    return (x >> 8).float() / (1 << 24)  # 24 bits, each value exact in float32


def argmax(logits):
    """logits: (R, V) float32 or float64 (numpy has no bf16) -> (R,) the first of each row's likeliest ids."""
    # NOTE: on a CPU numpy's argmax is several times faster than torch's (docs/floor_and_sampling.md)
    if logits.device.type == "cpu":
        return torch.from_numpy(logits.numpy().argmax(-1))
    return logits.argmax(-1)


def scale(candidates, temperature):
    """candidates (R, C) -> (candidates - each row's best) / temperature: log-probabilities up to a constant,
    the best at 0, so that a tiny temperature tends to greedy instead of overflowing."""
    return (candidates - candidates.amax(-1, keepdim=True)) / temperature


def cut_value(x, top_k, top_p):
    """x (R, K): scaled candidates, each row's best first -> (R, 1): the least value that top-k and top-p keep.
    Top-k keeps the k best, and any tied with the k-th; top-p keeps the best while the probability before
    them is below top_p, and any tied with the last kept (a top_p of 1 keeps every candidate)."""
    kth = x.gather(1, (top_k[:, None] - 1) % x.size(1))  # a row that does not cut (top_k 0) reads the last
    p = x.masked_fill(x < kth, float("-inf")).softmax(-1)  # top-p reads what top-k kept
    before = p.cumsum(-1) - p  # the probability of the candidates before each
    num_kept = (before < top_p[:, None]).sum(-1, keepdim=True)
    last_kept = x.gather(1, num_kept - 1)
    last_kept = last_kept.masked_fill(top_p[:, None] == 1, float("-inf"))  # top_p 1 keeps every candidate
    return torch.maximum(kth, last_kept)


def invert_cdf(x, least, u):
    """x (R, C) scaled candidates, least (R, 1), u (R,) -> (R, 1): the column whose CDF, over the columns
    of at least `least`, first passes u."""
    # unnormalized (x <= 0: no exp overflows), as u is scaled to the cumsum's end; the clamp catches a u rounded onto
    # it. A product with the mask: masked_fill took 2.7x as long on a CPU (7 ms at 64 x 50k)
    cdf = x.exp().mul_(x >= least).cumsum(-1)
    column = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
    return column.clamp(max=cdf.size(1) - 1)


def sample(logits, settings, position, num_best, uncut):
    """logits (R, V); settings (R, 5): each row's temperature, top_k (SamplingParams.best), top_p, min_p and
    seed; position (R,) -> (R,) token ids. Greedy rows (temperature 0) take the argmax; the others draw at
    uniform(seed, position): a row that cuts (top_k or top_p) among its best, sorted, the others in id order.
    min_p keeps the ids at least min_p x as likely as the best. num_best: how many best ids hold every cutting
    row's (0: no row cuts); uncut: whether some sampled row does not cut."""
    tokens = argmax(logits)
    if not (uncut or num_best):  # every row greedy
        return tokens
    temperature, top_k, top_p, min_p, seed = settings.T
    sampled = temperature > 0
    temperature = temperature.where(sampled, 1.0).float()[:, None]
    u = uniform(seed.long(), position)
    cuts = top_k > 0  # top_k: how many best ids a row keeps at most (top_p alone: every id), 0 if it does not cut
    least = min_p.log().float()[:, None]  # min-p's least scaled value, in the candidates' float32
    if uncut:  # every id, in id order
        drawn = invert_cdf(scale(logits.float(), temperature), least, u)[:, 0]
        tokens = drawn.where(sampled & ~cuts, tokens)
    if num_best:  # (R, K): the K best, sorted, so a row's cuts keep a prefix, and one more
        K = min(num_best + 1, logits.size(1))
        values, ids = logits.float().topk(K)
        x = scale(values, temperature)
        least = torch.maximum(least, cut_value(x, top_k.long(), top_p))
        if K < logits.size(1) and (x[:, -1:] >= least)[sampled & cuts].any():  # the one more kept: ties run past
            return sample(logits, settings, position, min(2 * num_best, logits.size(1)), uncut)
        drawn = ids.gather(1, invert_cdf(x, least, u))[:, 0]
        tokens = drawn.where(sampled & cuts, tokens)
    return tokens
