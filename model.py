"""A GPT in nanoGPT's shape and checkpoint format. Training attends causally over (B, T) blocks. Inference takes one flat batch of new tokens of many sequences; their
earlier K/V live wherever the step's batch keeps them, unseen by the model: it asks the batch to attend."""

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    block_size: int = 256
    vocab_size: int = 2048
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    bias: bool = True
    gelu: str = "exact"  # GPT-2's own weights were trained with the tanh approximation: "tanh"


def visible_keys(keys, q_pos):
    """keys: (B, L, H, D), q_pos: (B, Q) each query's position -> (B, 1, Q, L), one mask for every head: key j
    is visible to a query at position p iff j <= p. Causal, and blind to a row's padded end, as no query sits past
    its row's last key."""
    return torch.arange(keys.size(1), device=keys.device) <= q_pos[:, None, :, None]


def attend(q, k, v, mask=None):
    """q: (B, Q, H, D), k/v: (B, L, H, D), mask: broadcast to (B, H, Q, L), True (or 0, if additive) where a key
    is visible, as visible_keys builds it -> (B, Q, H, D). Without a mask every key is visible (SDPA takes none)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, *, D)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return y.transpose(1, 2)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0, f"n_embd {config.n_embd} is not a multiple of n_head {config.n_head}"
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.n_head = config.n_head

    def forward(self, x, batch, layer):
        # each (B, T, H, D) in training, (N, H, D) at inference
        q, k, v = self.c_attn(x).unflatten(-1, (3, self.n_head, -1)).unbind(-3)
        if batch is None:  # training: each of the B rows attends causally over itself
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        else:  # inference: new tokens of many sequences; the batch knows whose and where
            y = batch.attend(layer, q, k, v)
        return self.c_proj(y.flatten(-2))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU("none" if config.gelu == "exact" else config.gelu)  # its names for erf and tanh
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x):
        x = self.gelu(self.c_fc(x))
        return self.c_proj(x)


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, batch, layer):
        x = x + self.attn(self.ln_1(x), batch, layer)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as GPT-2
        for name, p in self.named_parameters():  # GPT-2's init; residual projections scaled by depth
            if p.dim() == 2:  # embeddings and linears (LayerNorm's ones and zeros stay)
                std = 0.02 / math.sqrt(2 * config.n_layer) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx, targets=None, batch=None):
        """Training: idx (B, T) -> logits (B, T, V), loss. Inference: idx (N,), batch: a StepBatch (batch.py)
        -> logits (S, V), one row for each token whose logits a sampler reads (batch.logit_rows)."""
        pos = torch.arange(idx.size(-1), device=idx.device) if batch is None else batch.positions
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for layer, block in enumerate(self.transformer.h):
            x = block(x, batch, layer)
        x = self.transformer.ln_f(x)
        if batch is not None:
            x = x[batch.logit_rows]  # only the tokens whose logits a sampler reads
        logits = self.lm_head(x)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=-1)
