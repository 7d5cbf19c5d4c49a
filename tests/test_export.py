"""Export to the Hugging Face GPT-2 format: transformers loads it and generates our tokens."""

import os

import pytest
import torch
from conftest import make_requests, run_engine, tiny_gpt
from test_model import save_nanogpt_ckpt

import generate
from ext import ServingEngine
from harness.checkpoints import get_tokenizer, load_checkpoint, shakespeare
from model import GPT, GPTConfig
from sequence import Request, SamplingParams

os.environ["HF_HUB_OFFLINE"] = "1"  # everything loads from the exported folder; nothing may be fetched
transformers = pytest.importorskip("transformers")


def export(tmp_path, model):
    save_nanogpt_ckpt(model, tmp_path / "ckpt.pt")
    out = tmp_path / "hf"
    generate.main(["--ckpt", str(tmp_path / "ckpt.pt"), "--export-hf", str(out)])
    return load_checkpoint(tmp_path / "ckpt.pt"), out


@pytest.mark.parametrize("vocab_size, bias", [(50304, True), (300, False)])
def test_exported_model_loads_in_transformers_with_our_logits_and_greedy_tokens(tmp_path, vocab_size, bias):
    """50,304: nanoGPT's padded GPT-2 vocabulary, trimmed to 50,257 on export; bias=False: zero biases."""
    torch.manual_seed(1)
    model = GPT(GPTConfig(block_size=64, vocab_size=vocab_size, n_layer=2, n_head=2, n_embd=32, bias=bias)).eval()
    ours, out = export(tmp_path, model)
    hf, info = transformers.GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    assert all(not keys for keys in info.values()), f"missing, unexpected or mismatched weights: {info}"
    num_tokens = get_tokenizer(vocab_size).n_vocab
    assert hf.config.vocab_size == num_tokens and hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()

    idx = torch.randint(0, num_tokens, (3, 40))
    with torch.no_grad():
        want = ours(idx)[0][..., :num_tokens]
        got = hf.eval()(idx).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # fp32 rounding: only the op order differs

    prompts = [idx[i, :n].tolist() for i, n in enumerate([5, 17, 30])]
    news = [20, 12, 30]
    engine = ServingEngine(ours.to(torch.float64), num_blocks=64, block_size=4, vocab_size=num_tokens)
    greedy = run_engine(engine, make_requests(prompts, news))
    hf = hf.to(torch.float64)
    hf.generation_config.eos_token_id = None  # ours generates exactly the asked-for count, end-of-text or not
    for prompt, n, tokens in zip(prompts, news, greedy):
        sequence = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
        assert sequence[0, len(prompt) :].tolist() == tokens


@pytest.mark.parametrize("vocab_size", [50304, 2048])
def test_exported_tokenizer_encodes_and_decodes_as_ours(tmp_path, vocab_size):
    _, out = export(tmp_path, tiny_gpt(vocab_size=vocab_size, dtype=torch.float32))
    theirs, ours = transformers.AutoTokenizer.from_pretrained(out), get_tokenizer(vocab_size)
    text = shakespeare()[1][:5000]
    ids = ours.encode_ordinary(text)
    assert theirs.encode(text) == ids and theirs.decode(ids) == text
    assert theirs.eos_token_id == ours.eot_token == len(theirs) - 1


def test_export_errors_are_one_line(tmp_path):
    save_nanogpt_ckpt(tiny_gpt(dtype=torch.float32), tmp_path / "ckpt.pt")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    (tmp_path / "file").write_text("a file")
    for ckpt, out, message in [
        ("none.pt", "new", "no checkpoint at"),
        ("ckpt.pt", "full", "exists and is not an empty folder"),
        ("ckpt.pt", "file", "exists and is not an empty folder"),
        ("ckpt.pt", "file/under", "cannot make the folder"),
    ]:
        with pytest.raises(SystemExit) as e:
            generate.main(["--ckpt", str(tmp_path / ckpt), "--export-hf", str(tmp_path / out)])
        assert e.value.code.startswith("error: ") and "\n" not in e.value.code and message in e.value.code
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("k", [2, 4])
def test_beam_search_equals_transformers_generate_with_num_beams(tmp_path, k):
    """Random GPT-2-vocabulary weights in float64, through the paged engine with a roomy pool and with
    one so small that beam groups are preempted: the best beam, every other beam in order, and their
    length-penalized scores, as HF's generate(num_beams=k, do_sample=False, num_return_sequences=k)."""
    torch.manual_seed(2)
    model = GPT(GPTConfig(block_size=64, vocab_size=50304, n_layer=2, n_head=2, n_embd=32)).eval()
    ours, out = export(tmp_path, model)
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval().to(torch.float64)
    hf.generation_config.eos_token_id = None  # no end-of-text in play: ours generates exactly max_new_tokens
    prompts = [torch.randint(0, 50257, (n,)).tolist() for n in (3, 11, 20, 7)]
    news = [9, 14, 6, 12]
    want = []
    for prompt, n in zip(prompts, news):
        result = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            num_beams=k,
            num_return_sequences=k,
            length_penalty=0.7,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
        want.append(([s[len(prompt) :].tolist() for s in result.sequences], result.sequences_scores.tolist()))
    ours = ours.to(torch.float64)
    for num_blocks in (200, 8 * k):
        engine = ServingEngine(ours, num_blocks=num_blocks, block_size=4, max_batch=4 * k, vocab_size=50257)
        requests = [Request(p, n, SamplingParams(num_beams=k, length_penalty=0.7)) for p, n in zip(prompts, news)]
        run_engine(engine, requests, check=True)
        assert engine.meter.num_preemptions > 0 or num_blocks == 200
        for r, (sequences, scores) in zip(requests, want):
            assert r.generated == sequences[0] and [s.generated for s in r.sequences] == sequences
            torch.testing.assert_close([s.score for s in r.sequences], scores, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("gelu", ["exact", "tanh"])
def test_to_transformers_gives_our_logits_and_greedy_tokens_in_memory(gelu):
    """harness/checkpoints.py's to_transformers, the benchmarks' HF peer on the same weights: float64 logits equal ours, and
    its greedy generate, with no eos, our greedy tokens."""
    from harness.checkpoints import to_transformers

    model = tiny_gpt(seed=4)
    with torch.no_grad():  # weights of float64's precision: a float32 copy on the way would round them
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-12)
    model.config.gelu = gelu
    for block in model.transformer.h:
        block.mlp.gelu = torch.nn.GELU("none" if gelu == "exact" else "tanh")
    hf = to_transformers(model)  # in the model's float64, every weight as it is
    assert hf.dtype == torch.float64
    x = torch.tensor([[5, 17, 42, 7, 99, 3]])
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x)[0], rtol=0, atol=1e-10)
        out = hf.generate(x, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    [want] = run_engine(ServingEngine(model, num_blocks=16, block_size=4), make_requests([x[0].tolist()], [12]))
    assert out[0, x.shape[1] :].tolist() == want
