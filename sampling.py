"""How the engine picks each next token from its logits: greedy rows take the argmax, sampled rows draw from a
hash of (seed, position) on the logits' device, with no generator state. A sampled row keeps
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
    """seed, position: (R,) int64 -> (R,) floats in (0, 1), a hash of (seed, position): a sequence's draw at
    position p is the same whatever runs beside it or ran before. Each is the middle of one of 2**23 equal
    intervals, never 0: the draw's CDF search then never lands on an id of no weight before the first with some
    (an id at -inf, which sample() clamps to a weight of ~1e-38)."""
    x = mix32((mix32(seed) + position) & UINT32)  # seed: 32 bits, as the engine keeps it
    return (x >> 8 | 1) / 2**24  # odd multiples of 2**-24: 24 bits, each value exact in float32


def argmax(logits):
    """logits: (R, V) float32 or float64 (numpy has no bf16) -> (R,) the first of each row's likeliest ids."""
    # NOTE: on a CPU numpy's argmax is several times faster than torch's (docs/floor_and_sampling.md)
    if logits.is_cuda:
        return logits.argmax(-1)
    return torch.from_numpy(logits.numpy().argmax(-1))


def scale(candidates, temperature):
    """candidates (R, C) -> (candidates - each row's best) / temperature: log-probabilities up to a constant,
    the best at 0, so that a tiny temperature tends to greedy instead of overflowing."""
    return (candidates - candidates.amax(-1, keepdim=True)).div_(temperature)


def sorted_values(x):
    """x (R, C) -> each row's values, best first: what top-p alone reads, with no ids. On a CPU x is sorted in
    place, by numpy."""
    # NOTE: on a CPU numpy's sort (values only) is ~9x as fast as torch's sort, and torch's topk of a whole row is
    # slower still (docs/floor_and_sampling.md)
    if x.is_cuda:
        return x.sort(descending=True).values
    x.numpy().sort()
    return x.fliplr()


def cut_value(x, top_k, top_p, least):
    """x (R, K): scaled candidates, each row's best first -> (R, 1): the least value that top-k, top-p and min-p
    keep, and (R, 1) the k-th. Top-k keeps the k best, and any tied with the k-th; top-p keeps the best while the
    probability before them is below top_p, and any tied with the last kept (a top_p of 1 keeps every candidate);
    min-p keeps those of at least `least` (R, 1)."""
    kth = x.gather(1, (top_k[:, None].long() - 1) % x.size(1))  # a row that does not cut (top_k 0) reads the last
    p = x.exp().mul_(x >= kth)  # unnormalized (x <= 0): top-p reads what top-k kept
    mass = p.cumsum(-1)  # up to each candidate, itself included
    # the last kept: the mass before it (which never falls, as p never rises) below top_p of the whole
    last_kept = x.gather(1, torch.searchsorted(mass - p, top_p[:, None] * mass[:, -1:]) - 1)
    # a top_p of 1 keeps every candidate, whatever the rounding of the mass
    return kth.maximum(least).maximum(last_kept.masked_fill(top_p[:, None] == 1, float("-inf"))), kth


def invert_cdf(x, least, u):
    """x (R, C) scaled candidates, least (R, 1), u (R,) -> (R, 1): the column whose CDF, over the columns
    of at least `least`, first passes u."""
    # unnormalized (x <= 0: no exp overflows), as u is scaled to the cumsum's end; the clamp catches a u rounded onto
    # it. A product with the mask: masked_fill took 2.7x as long on a CPU (7 ms at 64 x 50k)
    cdf = x.exp().mul_(x >= least).cumsum_(-1)
    column = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
    return column.clamp(max=cdf.size(1) - 1)


def sample(logits, settings, position, num_best, uncut):
    """logits (R, V); settings (R, 5): each row's temperature, top_k (SamplingParams.best), top_p, min_p and
    seed; position (R,) -> (R,) token ids. Greedy rows (temperature 0) take the argmax; the others draw at
    uniform(seed, position): a row with a top_k among its best, sorted, the others in id order. top_p alone
    finds its cut in every id's value, sorted once for all such rows; min_p keeps the ids at least min_p x as
    likely as the best. num_best: how many best ids hold every top_k row's (0: none); uncut: whether some
    sampled row has no top_k."""
    tokens = argmax(logits)
    if not (uncut or num_best):  # every row greedy
        return tokens
    V = logits.size(1)
    # the settings in the candidates' float32, so that no op over a row widens it to float64 (the seed: below)
    temperature, top_k, top_p, min_p, _ = settings.float().T
    sampled = temperature > 0
    temperature = temperature.where(sampled, 1.0)[:, None]
    u = uniform(settings[:, 4].long(), position)  # the seed's 32 bits, exact in the float64 settings
    cuts = top_k > 0  # top_k: how many best ids a row keeps at most, 0 if it keeps every id
    least = min_p.log()[:, None]  # min-p's least scaled value
    if num_best:  # (R, K): the K best, sorted, so a row's cuts keep a prefix, and one more
        K = min(num_best + 1, V)
        values, ids = logits.float().topk(K)
        x = scale(values, temperature)
        kept, kth = cut_value(x, top_k, top_p, least)
        # ties with the k-th run past the candidates: top-p's mass, and so its cut, would miss them
        if K < V and (x[:, -1:] >= kth)[sampled & cuts].any():
            return sample(logits, settings, position, 2 * num_best, uncut)
        column = invert_cdf(x, kept, u)  # (R, 1)
        tokens = ids.gather(1, column)[:, 0].where(sampled & cuts, tokens)
    if uncut:  # every id, in id order
        # NOTE: clamped where exp underflows float32: torch's CPU exp takes a slow path there, up to 60x the time
        # (docs/floor_and_sampling.md). A clamped id weighs exp(-87) of the best id's weight (an id at -inf too), never
        # drawn: before the first id of some weight they sum below the least target (u > 0), after it within rounding
        x = scale(logits.float(), temperature).clamp_(-87.0)
        alone = sampled & ~cuts & (top_p < 1)  # top-p alone: where to cut, from the row's every value sorted
        least[alone] = cut_value(sorted_values(x[alone]), top_k[alone], top_p[alone], least[alone])[0]
        tokens = invert_cdf(x, least, u)[:, 0].where(sampled & ~cuts, tokens)
    return tokens
