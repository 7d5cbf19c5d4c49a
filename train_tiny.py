"""Train a tiny GPT on Shakespeare for a fixed 1,000 iterations and save it as a nanoGPT checkpoint.

    python train_tiny.py [--max-iters 1000 --n-embd 128 ...]      # python train_tiny.py --help

The data are real and local: GPT-2's BPE and Shakespeare's plays, from checkpoints.py. Nothing is downloaded.
"""

import argparse
import math
import os
import sys
import time

import torch

from harness.checkpoints import get_tokenizer, shakespeare
from harness.flags import HelpFormatter, fail, number_type
from model import GPT, GPTConfig


def train(
    out_dir="out", device=None, max_iters=1000, max_seconds=None, batch_size=16, lr=2e-3, seed=1337, **model_args
):
    """Train max_iters iterations from a fixed seed, so every machine gets the same model; max_seconds,
    if given, may cut that short, and the run then says so."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    os.makedirs(out_dir, exist_ok=True)  # now, not after training
    torch.manual_seed(seed)
    config = GPTConfig(**model_args)
    enc = get_tokenizer(config.vocab_size)
    data = {split: torch.tensor(enc.encode_ordinary(text)) for split, text in zip(["train", "val"], shakespeare())}
    model = GPT(config).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tiny GPT, {n_params / 1e6:.2f}M parameters: {config}")
    print(
        f"Shakespeare: {len(data['train']):,} train / {len(data['val']):,} val tokens; "
        f"{max_iters} iterations on {device}",
        flush=True,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.1)

    def batch(split):
        ix = torch.randint(len(data[split]) - config.block_size - 1, (batch_size, 1)) + torch.arange(
            config.block_size + 1
        )
        xy = data[split][ix].to(device)  # (B, T + 1)
        return xy[:, :-1], xy[:, 1:]

    start = last_print = time.time()
    it = 0
    while it < max_iters and (max_seconds is None or time.time() - start < max_seconds):
        progress = it / max_iters  # warmup, then cosine decay to 5% of lr
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (it + 1) / 50) * max(0.05, 0.5 * (1 + math.cos(math.pi * progress)))
        _, loss = model(*batch("train"))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        it += 1
        if time.time() - last_print >= 10 or it in (1, max_iters):  # a slow machine never looks frozen
            elapsed, last_print = time.time() - start, time.time()
            print(
                f"iter {it:5d}/{max_iters}  loss {loss.item():.3f}  {elapsed:4.0f}s elapsed, "
                f"~{elapsed / it * (max_iters - it):.0f}s left",
                flush=True,
            )
    model.eval()
    with torch.no_grad():
        val_loss = sum(model(*batch("val"))[1].item() for _ in range(40)) / 40
    print(f"done: {it} iterations in {time.time() - start:.0f}s, val loss {val_loss:.3f}")
    if it < max_iters:
        print(
            f"WARNING: --max-seconds {max_seconds:g} stopped training after {it} of {max_iters} iterations; "
            f"this checkpoint (val loss {val_loss:.3f}) is weaker than a full run's"
        )
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "model_args": vars(config),
            "iter_num": it,
            "best_val_loss": val_loss,
            "config": {"dataset": "shakespeare", "lr": lr},
        },
        os.path.join(out_dir, "ckpt.pt"),
    )
    print(f"saved {out_dir}/ckpt.pt")
    return model


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.error = lambda message: fail(message)  # one line, no usage dump
    p.add_argument("--out-dir", default="out", help="where ckpt.pt is written")
    p.add_argument("--device", default="", help="cpu or cuda; empty picks cuda if available")
    p.add_argument(
        "--max-iters", type=number_type(1), default=1000, help="training iterations; the same on every machine"
    )
    p.add_argument(
        "--max-seconds",
        type=number_type(above=0, kind=float),
        default=None,
        help="optional time cap; says so if it cuts training short",
    )
    p.add_argument("--batch-size", type=number_type(1), default=16, help="sequences per iteration")
    p.add_argument(
        "--lr", type=number_type(above=0, kind=float), default=2e-3, help="peak learning rate (warmup, then cosine)"
    )
    p.add_argument("--seed", type=int, default=1337, help="seeds the weights and the batches")
    for name, value in vars(GPTConfig()).items():  # the model's shape, nanoGPT's names
        flag, about = "--" + name.replace("_", "-"), "GPTConfig." + name
        if name == "gelu":
            p.add_argument(flag, choices=["exact", "tanh"], default=value, help=about)
        elif not isinstance(value, bool):  # bias stays as GPTConfig has it
            p.add_argument(flag, type=number_type(1), default=value, help=about)
    args = p.parse_args()
    if args.n_embd % args.n_head:
        fail(f"--n-embd {args.n_embd} is not a multiple of --n-head {args.n_head}")
    if args.device and args.device.partition(":")[0] not in ("cpu", "cuda"):
        fail(f"--device {args.device}: this trains on cpu or cuda")
    try:
        train(**vars(args))
    except OSError as e:  # the output folder, before any training
        sys.exit(f"error: --out-dir {args.out_dir}: {e.strerror}")
    except ValueError as e:  # the tokenizer's, for a vocabulary too small for GPT-2's bytes
        sys.exit(f"error: {e}")
