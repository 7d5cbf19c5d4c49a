"""Loading Hugging Face GPT-2 folders (--ckpt DIR): logits and greedy tokens equal HF's, for both GELUs."""

import json

import pytest
import torch
from conftest import run_engine, tiny_gpt
from test_model import save_nanogpt_ckpt

import generate
from harness.checkpoints import export_hf, load_checkpoint
from scheduler import PagedEngine
from sequence import Request

transformers = pytest.importorskip("transformers")


def random_hf_gpt2(activation="gelu_new", seed=0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=50257, n_positions=64, n_embd=32, n_layer=2, n_head=2, activation_function=activation
    )
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.mark.parametrize("activation", ["gelu", "gelu_new"])
@pytest.mark.parametrize("safe", [True, False])
def test_hf_gpt2_folder_loads_with_hf_logits_and_greedy_tokens(tmp_path, activation, safe):
    hf = random_hf_gpt2(activation)
    hf.save_pretrained(tmp_path, safe_serialization=safe)
    ours = load_checkpoint(str(tmp_path))
    assert ours.config.gelu == ("exact" if activation == "gelu" else "tanh")
    idx = torch.randint(0, 50257, (2, 30))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0], hf(idx).logits, rtol=1e-5, atol=1e-5)
    prompts = [torch.randint(0, 50257, (n,)).tolist() for n in (3, 9, 17)]
    hf.generation_config.eos_token_id = None  # run to max_new_tokens, as ours does by default
    want = [
        hf.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            do_sample=False,
            max_new_tokens=12,
            pad_token_id=0,
        )[0, len(p) :].tolist()
        for p in prompts
    ]
    got = run_engine(PagedEngine(ours, num_blocks=60, block_size=4), [Request(p, 12) for p in prompts])
    assert got == want


def test_hub_layout_without_prefix_or_lm_head_loads(tmp_path):
    """GPT-2's own hub files name weights without 'transformer.' and keep no lm_head: it is tied."""
    hf = random_hf_gpt2("gelu_new", seed=1)
    hub = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    hub["h.0.attn.bias"] = torch.tril(torch.ones(64, 64))[None, None]  # old files keep the causal mask
    torch.save(hub, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps(hf.config.to_dict()))
    idx = torch.randint(0, 50257, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(load_checkpoint(str(tmp_path))(idx)[0], hf(idx).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gelu", ["exact", "tanh"])
def test_export_then_load_gives_back_the_same_model(tmp_path, gelu):
    model = tiny_gpt(seed=4, vocab_size=50257, dtype=torch.float32)
    model.config.gelu = gelu
    for mlp in (b.mlp for b in model.transformer.h):
        mlp.gelu = torch.nn.GELU("none" if gelu == "exact" else gelu)
    export_hf(model, str(tmp_path / "hf"))
    loaded = load_checkpoint(str(tmp_path / "hf"))
    idx = torch.randint(0, 50257, (2, 25))
    with torch.no_grad():
        assert torch.equal(loaded(idx)[0], model(idx)[0]) and loaded.config.gelu == gelu


def test_folders_that_are_not_gpt2_are_one_line_errors(tmp_path):
    hf = random_hf_gpt2("gelu_new")
    cases = {
        "empty": ({}, None, "config.json"),
        "llama": ({"model_type": "llama"}, None, "model_type 'llama'"),
        "relu": ({"activation_function": "relu"}, None, "activation 'relu'"),
        "noweights": ({}, "none", "no model.safetensors or pytorch_model.bin"),
        "corrupt": ({}, "corrupt", "cannot load"),
    }
    for name, (change, weights, message) in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        if name != "empty":
            (folder / "config.json").write_text(json.dumps({**hf.config.to_dict(), **change}))
            if weights == "corrupt":
                (folder / "model.safetensors").write_bytes(b"not safetensors")
            elif weights is None:
                hf.save_pretrained(folder)
                (folder / "config.json").write_text(json.dumps({**hf.config.to_dict(), **change}))
        with pytest.raises(SystemExit) as e:
            generate.main(["--ckpt", str(folder), "--max-new-tokens", "4"])
        assert e.value.code.startswith("error: ") and "\n" not in e.value.code and message in e.value.code, name


def test_a_config_that_is_no_json_object_and_an_untied_checkpoint_are_one_line_errors(tmp_path):
    folder = tmp_path / "listed"
    folder.mkdir()
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="its config.json holds a list, not a model's settings") as e:
        load_checkpoint(folder)
    assert "\n" not in str(e.value)
    model = tiny_gpt(dtype=torch.float32)
    save_nanogpt_ckpt(model, tmp_path / "ckpt.pt")
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    ckpt["model"]["lm_head.weight"] = ckpt["model"]["lm_head.weight"] + 1  # trained untied: the model cannot hold it
    torch.save(ckpt, tmp_path / "untied.pt")
    with pytest.raises(ValueError, match="its lm_head differs from its token embedding"):
        load_checkpoint(tmp_path / "untied.pt")


def test_nanogpt_checkpoint_gelu_is_optional_and_checked(tmp_path):
    model = tiny_gpt(dtype=torch.float32)
    save_nanogpt_ckpt(model, tmp_path / "ckpt.pt")
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    del ckpt["model_args"]["gelu"]  # nanoGPT's own checkpoints predate it, and mean the erf GELU
    torch.save(ckpt, tmp_path / "old.pt")
    assert load_checkpoint(tmp_path / "old.pt").config.gelu == "exact"
    ckpt["model_args"]["gelu"] = "relu"
    torch.save(ckpt, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="gelu is 'relu'") as e:
        load_checkpoint(tmp_path / "bad.pt")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "name, change, weights, message",
    [
        ("empty", None, None, "config.json"),
        ("llama", {"model_type": "llama"}, "safe", "model_type 'llama'"),
        ("relu", {"activation_function": "relu"}, "safe", "activation 'relu'"),
        ("gelu_fast", {"activation_function": "gelu_fast"}, "safe", "activation 'gelu_fast'"),
        ("heads", {"architectures": ["GPT2DoubleHeadsModel"]}, "safe", "GPT2DoubleHeadsModel"),
        ("n_inner", {"n_inner": 100}, "safe", "n_inner 100"),
        ("eps", {"layer_norm_epsilon": 1e-6}, "safe", "layer_norm_epsilon"),
        ("untied", {"tie_word_embeddings": False}, "safe", "untied"),
        ("scaled", {"scale_attn_by_inverse_layer_idx": True}, "safe", "rescaled attention"),
        ("unscaled", {"scale_attn_weights": False}, "safe", "attention scores not scaled"),
        ("cross", {"add_cross_attention": True}, "safe", "cross-attention"),
        ("noweights", {}, None, "no model.safetensors or pytorch_model.bin"),
        ("corrupt", {}, "corrupt", "cannot load"),
    ],
)
def test_folders_we_cannot_compute_are_one_line_errors(tmp_path, name, change, weights, message):
    hf = random_hf_gpt2()
    if weights == "safe":
        hf.save_pretrained(tmp_path)
    elif weights == "corrupt":
        (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    if change is not None:
        (tmp_path / "config.json").write_text(json.dumps({**hf.config.to_dict(), **change}))
    with pytest.raises(ValueError) as e:
        load_checkpoint(str(tmp_path))
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
