"""The contiguous baseline that the paged engine is measured against, token for token and in speed: the
same Engine (engine.py), with the forks extension, and each sequence's K/V in tensors of its own, grown by
torch.cat."""

import torch
from torch.nn.utils.rnn import pad_sequence

from batch import StepBatch
from engine import Engine, PlanEntry
from ext.forks import Forks, num_rows, rows_held, width
from model import attend, visible_keys
from sequence import SequenceStatus


class ContiguousBatch(StepBatch):
    """The baseline's cache seen by one forward: each sequence's K/V are its own tensors, grown by
    torch.cat every step; decode rows are padded side by side to attend in one call."""

    def __init__(self, plan, samplers, device):
        super().__init__(plan, samplers, device)
        self.sequences = [s for s, _ in plan]
        [self.decode_pos] = self.stage(self.kv_lens[: self.num_one_token, None] - 1)  # (B, 1) each one's last position

    def store(self, layer, k, v):  # k, v: (N, H, D)
        for s, (a, b) in zip(self.sequences, self.spans):
            s.k[layer] = torch.cat([s.k[layer], k[a:b]])
            s.v[layer] = torch.cat([s.v[layer], v[a:b]])

    def attend_one_token(self, layer, q):  # q: (B, H, D)
        decoding = self.sequences[: self.num_one_token]
        k = pad_sequence([s.k[layer] for s in decoding], batch_first=True)  # (B, L, H, D)
        v = pad_sequence([s.v[layer] for s in decoding], batch_first=True)
        return attend(q[:, None], k, v, visible_keys(k, self.decode_pos))[:, 0]

    def chunk_kv(self, layer, chunk):
        s = self.sequences[chunk.entry]
        return s.k[layer][None], s.v[layer][None]


class ContiguousEngine(Forks, Engine):
    """Continuous batching without paging: up to max_batch sequences run; a new one is prefilled whole
    in the same forward that decodes the others. Under a KV budget (token slots), a request is admitted
    only if its reservation fits in what is left, and holds it until it finishes, as the vLLM paper's
    baselines do: the whole context (max: FasterTransformer, Orca (Max)), prompt + max_new_tokens
    rounded up to a power of two (pow2: Orca (Pow2)), or exactly (oracle: Orca (Oracle))."""

    def __init__(self, model, *, max_batch=64, vocab_size=None, kv_budget=None, reserve="max", early_stopping=False):
        super().__init__(model, max_batch=max_batch, vocab_size=vocab_size, early_stopping=early_stopping)
        if max_batch < 1 or reserve not in ("max", "pow2", "oracle") or (kv_budget is not None and kv_budget < 1):
            raise ValueError(
                f"max_batch {max_batch} and kv_budget {kv_budget} must be at least 1, reserve {reserve!r} max, pow2 or oracle"
            )
        self.kv_budget = kv_budget
        self.reserve = reserve
        self.reserved = 0  # token slots reserved by the running sequences

    def reservation(self, r):
        need = len(r.prompt) + r.max_new_tokens
        slots = dict(max=self.window, pow2=1 << (need - 1).bit_length(), oracle=need)
        return min(self.window, slots[self.reserve])

    def check(self, r):
        super().check(r)
        need = self.reservation(r) * width(r)  # as schedule() reserves: for every sequence it will run
        if self.kv_budget is not None and need > self.kv_budget:
            each = f" for each of {width(r)} sequences" if width(r) > 1 else ""
            raise ValueError(
                f"a request of {len(r.prompt)} + {r.max_new_tokens} tokens reserves {self.reservation(r)} "
                f"slots{each} under --reserve {self.reserve}, but the KV budget is {self.kv_budget} slots"
            )

    def schedule(self):  # a request reserves for all the sequences it will fork into
        c = self.model.config
        while self.waiting and rows_held(self.running + [self.waiting[0]]) <= self.max_batch:
            s = self.waiting[0]
            need = self.reservation(s.request) * num_rows(s)
            if self.kv_budget is not None and self.reserved + need > self.kv_budget:
                break
            self.reserved += need
            dtype = self.model.lm_head.weight.dtype
            empty = torch.empty(0, c.n_head, c.n_embd // c.n_head, device=self.device, dtype=dtype)
            s.k = [empty] * c.n_layer  # one tensor per layer, (L, H, D)
            s.v = [empty] * c.n_layer
            self.start(self.waiting.popleft())
        plan = [PlanEntry(s, s.num_uncomputed()) for s in self.running]
        return sorted(plan, key=lambda e: e.num_tokens > 1)  # one-token entries first: they attend together

    def make_batch(self, plan, samplers):
        return ContiguousBatch(plan, samplers, self.device)

    def fork_kv(self, parent, child):  # torch.cat makes a new tensor on every append: sharing the old ones is safe
        child.k = list(parent.k)
        child.v = list(parent.v)
        child.num_computed = parent.num_computed

    def release(self, s):
        s.k = s.v = None
        if s.status is not SequenceStatus.DEAD:  # a dead beam's reservation passes to the fork that replaces it
            self.reserved -= self.reservation(s.request)
