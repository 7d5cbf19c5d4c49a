"""The tiny GPT: its cached forward against a full recompute, the linears the engines prepack, and its
checkpoints (nanoGPT's, one made from GPT-2's weights, train_tiny's), the tokenizer and the plays."""

import numpy as np
import pytest
import torch
from conftest import make_requests, run_engine, tiny_gpt

from engine import PlanEntry, Sampler
from harness import tuning
from harness.checkpoints import get_tokenizer, load_checkpoint, shakespeare
from harness.contiguous import ContiguousBatch, ContiguousEngine
from harness.tuning import SMALL_GELU, PackedLinear, SmallGELU, prepare
from model import GPT, GPTConfig
from paged import PagedBatch
from scheduler import PagedEngine
from sequence import Request


def incremental_logits(model, prompts, decode_steps, make_batch):
    """Prefill every prompt in one forward, then decode all together; returns each step's logits."""
    reqs = [Request(p, decode_steps + 1).sequences[0] for p in prompts]
    c = model.config
    for i, r in enumerate(reqs):
        r.row = i
        r.k = [torch.empty(0, c.n_head, c.n_embd // c.n_head, dtype=torch.float64)] * c.n_layer
        r.v = list(r.k)
    steps = []
    with torch.no_grad():
        for _ in range(decode_steps + 1):
            plan = sorted([PlanEntry(r, r.num_uncomputed()) for r in reqs], key=lambda entry: entry.num_tokens > 1)
            batch = make_batch(plan, [Sampler(r, i) for i, (r, _) in enumerate(plan)])
            logits, _ = model(batch.idx, batch=batch)
            for (r, n), row in zip(plan, logits):
                r.num_computed += n
                r.tokens.append(int(row.argmax()))
            order = [reqs.index(r) for r, _ in plan]
            steps.append(logits[torch.tensor(order).argsort()])
    return reqs, steps


@pytest.mark.parametrize("cache", ["contiguous", "paged", "paged, compiled"])
def test_cached_decode_equals_full_recompute(model, cache):
    prompts = [
        [5, 6, 7, 8, 9],
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
        [42],
        [7, 7, 7],
        [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8],
    ]
    k_pool, v_pool = (
        torch.zeros(2, 65, 3, 2, 16, dtype=torch.float64),
        torch.zeros(2, 65, 3, 2, 16, dtype=torch.float64),
    )
    # scattered blocks: request i owns blocks i, i + 8, i + 16, ...; block 64 is padding's
    block_tables = np.array([[i + 8 * j for j in range(8)] for i in range(len(prompts))], dtype=np.int32)

    cpu = torch.device("cpu")

    def paged_batch(plan, samplers):
        return PagedBatch(plan, samplers, cpu, (k_pool, v_pool), block_tables, compiled="compiled" in cache)

    make_batch = (
        paged_batch if cache.startswith("paged") else (lambda plan, samplers: ContiguousBatch(plan, samplers, cpu))
    )
    reqs, steps = incremental_logits(model, prompts, 6, make_batch)
    with torch.no_grad():
        for i, r in enumerate(reqs):
            full, _ = model(torch.tensor(r.tokens[:-1])[None])  # (1, T, V), no cache
            for step, logits in enumerate(steps):
                pos = len(prompts[i]) - 1 + step
                torch.testing.assert_close(logits[i], full[0, pos], rtol=0, atol=1e-10)


def test_prepare_packs_the_callers_big_linears_and_engines_never_serve_a_stale_packed_weight():
    """An engine changes no model: harness.tuning.prepare, which generate.py and example.py call first, packs every float32
    Linear of 2**17 weights or more, and not the smaller ones (packed, they run slower). Both engines then give
    an unpacked copy's greedy tokens, and a weight changed after they were built is multiplied as it is now: its
    packed copy, made from the old version, is skipped."""
    shape = dict(n_embd=256, n_head=4)  # c_attn, c_fc and the MLP's c_proj are 2**17 or more; the rest smaller
    prompts, news = [[5, 6, 7, 8, 9], list(range(1, 20)), [42], [3, 1, 4, 1, 5, 9]], [12, 8, 16, 10]

    def unpacked_tokens(model):  # a fresh model with model's weights, not prepared: its Linears take F.linear
        fresh = tiny_gpt(dtype=torch.float32, **shape)
        fresh.load_state_dict(model.state_dict())
        return run_engine(ContiguousEngine(fresh), make_requests(prompts, news))

    for make in (lambda model: PagedEngine(model, num_blocks=40, block_size=4), ContiguousEngine):
        model = tiny_gpt(seed=5, dtype=torch.float32, **shape)
        make(model)
        assert not any(isinstance(m, PackedLinear) for m in model.modules()), "an engine packed its model"
        prepare(model)
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        assert model.lm_head.weight is model.transformer.wte.weight, "packing untied the weights"
        before, after = make(model), make(model)  # after runs once the weight changed: its prefix cache is empty
        packed = [isinstance(m, PackedLinear) and m.packed_version == m.weight._version for m in linears]
        assert packed == [m.weight.numel() >= 1 << 17 for m in linears], "prepare did not pack the big linears"
        assert 0 < sum(packed) < len(packed)
        want = unpacked_tokens(model)
        assert run_engine(before, make_requests(prompts, news)) == want
        c_fc = model.transformer.h[0].mlp.c_fc
        with torch.no_grad():
            c_fc.weight.mul_(-3.0)  # a change after the engines were built
        assert c_fc.packed_version != c_fc.weight._version
        changed = unpacked_tokens(model)
        assert changed != want, "the change does not show in the tokens"
        assert run_engine(after, make_requests(prompts, news)) == changed


def test_prepare_copies_a_narrow_float32_weight_k_major_for_mkl_and_it_computes_what_the_linear_does(monkeypatch):
    """A packed float32 linear of at most MKL_MAX_INPUTS inputs (the shipped model's lm_head, 128 -> 2,048) keeps
    a K-major copy for MKL instead of oneDNN's layout; wider ones and bf16 keep oneDNN's. Each computes what
    F.linear does, and the engine gives an unprepared copy's greedy tokens; a weight changed since is not used.
    The rule is an Intel CPU's (elsewhere MKL_MAX_INPUTS is 0); here it holds on any CPU."""
    assert tuning.MKL_MAX_INPUTS == (128 if tuning.intel_cpu() else 0)
    monkeypatch.setattr(tuning, "MKL_MAX_INPUTS", 128)
    model = tiny_gpt(seed=3, dtype=torch.float32, n_embd=128, n_head=4, vocab_size=1024)  # lm_head: 2**17 weights
    fresh = tiny_gpt(seed=3, dtype=torch.float32, n_embd=128, n_head=4, vocab_size=1024)
    prepare(model)
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert packed == [model.lm_head] and model.lm_head.k_major and model.lm_head.packed_weight.shape == (128, 1024)
    x = torch.randn(5, 128)
    with torch.no_grad():
        torch.testing.assert_close(model.lm_head(x), torch.nn.functional.linear(x, model.lm_head.weight))
    prompts, news = [[5, 6, 7, 8, 9], list(range(1, 20)), [42]], [12, 8, 16]
    want = run_engine(ContiguousEngine(fresh), make_requests(prompts, news))
    assert run_engine(PagedEngine(model, num_blocks=40, block_size=4), make_requests(prompts, news)) == want
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)  # the copy is stale: F.linear runs, on the weight as it is now
        assert torch.equal(model.lm_head(x), torch.nn.functional.linear(x, model.lm_head.weight))
    wide = prepare(tiny_gpt(seed=3, dtype=torch.float32, n_embd=256, n_head=4, vocab_size=1024))
    assert not wide.lm_head.k_major


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_prepare_gives_small_gelus_torchs_own_kernel_with_gelus_values_and_leaves_the_switch_as_it_was(approximate):
    """prepare swaps each nn.GELU for a SmallGELU of the same approximation, which turns oneDNN off around its own
    call below SMALL_GELU values only: in float32, the bits of the kernel it should take; the values are nn.GELU's,
    exactly in float64 (never oneDNN's) and within the two kernels' rounding in float32 and bf16; and the switch
    is back as it was after each call, error or not."""
    model = tiny_gpt(seed=5, dtype=torch.float32)
    for block in model.transformer.h:
        block.mlp.gelu = torch.nn.GELU(approximate)
    prepare(model)
    gelus = [m for m in model.modules() if isinstance(m, torch.nn.GELU)]
    assert len(gelus) == len(model.transformer.h) and all(type(m) is SmallGELU for m in gelus)
    assert all(m.approximate == approximate for m in gelus)
    gelu, torch_gelu = gelus[0], torch.nn.GELU(approximate)
    for rows in (1, 3, SMALL_GELU // 64 - 1, SMALL_GELU // 64, SMALL_GELU // 64 + 5):  # below the threshold and not
        x = torch.randn(rows, 64, dtype=torch.float64) * 4
        assert torch.equal(gelu(x), torch_gelu(x))
        with torch.backends.mkldnn.flags(enabled=x.numel() >= SMALL_GELU):  # the kernel it should take: its bits
            assert torch.equal(gelu(x.float()), torch_gelu(x.float()))
        torch.testing.assert_close(gelu(x.float()), torch_gelu(x.float()), rtol=0, atol=2e-6)
        torch.testing.assert_close(gelu(x.bfloat16()), torch_gelu(x.bfloat16()), rtol=0, atol=0.07)
    for enabled in (True, False):
        with torch.backends.mkldnn.flags(enabled=enabled):
            gelu(torch.randn(2, 8))
            with pytest.raises(NotImplementedError):
                gelu(torch.ones(2, 8, dtype=torch.int64))  # GELU takes no integers: raised inside the call
            assert torch.backends.mkldnn.enabled == enabled


def save_nanogpt_ckpt(model, path, prefix=""):
    state = {prefix + k: v for k, v in model.state_dict().items()}
    torch.save(
        {
            "model": state,
            "model_args": vars(model.config),
            "iter_num": 7,
            "best_val_loss": 3.0,
            "config": {"dataset": "shakespeare"},
            "optimizer": {},
        },
        path,
    )


@pytest.mark.parametrize("prefix", ["", "_orig_mod."])
def test_checkpoint_round_trip_gives_identical_logits(tmp_path, prefix):
    model = tiny_gpt(seed=3, dtype=torch.float32)
    save_nanogpt_ckpt(model, tmp_path / "ckpt.pt", prefix)
    loaded = load_checkpoint(tmp_path / "ckpt.pt")
    idx = torch.randint(0, 300, (2, 20))
    assert torch.equal(model(idx)[0], loaded(idx)[0])


def test_a_nanogpt_checkpoint_made_from_gpt2_weights_loads_without_its_mask_buffers(tmp_path):
    """A checkpoint as nanoGPT's from_pretrained makes one from GPT-2 (HF) weights: the test transposes the
    Conv1D weights into nanoGPT's layout itself, as from_pretrained does, and keeps the causal-mask buffers
    nanoGPT or HF hold. It loads unchanged, the buffers dropped; vocab 50257 picks the full GPT-2 BPE.
    (Hugging Face folders, whose Conv1D weights the loader transposes, are tests/test_hf_load.py's.)"""
    config = GPTConfig(block_size=32, vocab_size=50257, n_layer=1, n_head=2, n_embd=16)
    torch.manual_seed(0)
    ours = GPT(config).eval()
    hf = {
        k.removeprefix("transformer."): (v.t() if k.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")) else v)
        for k, v in ours.state_dict().items()
        if k != "lm_head.weight"
    }  # HF keeps Conv1D as (in, out)
    hf["h.0.attn.bias"] = torch.tril(torch.ones(32, 32))[None, None]
    converted = {
        ("transformer." + k): (v.t() if k.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")) else v)
        for k, v in hf.items()
    }
    converted["lm_head.weight"] = converted["transformer.wte.weight"]
    torch.save({"model": converted, "model_args": vars(config)}, tmp_path / "gpt2.pt")
    loaded = load_checkpoint(tmp_path / "gpt2.pt")
    idx = torch.randint(0, 50257, (1, 10))
    assert torch.equal(ours(idx)[0], loaded(idx)[0])
    assert get_tokenizer(loaded.config.vocab_size).eot_token == 50256


def test_missing_and_corrupt_checkpoints_raise_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "nope.pt")
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="cannot read checkpoint") as e:
        load_checkpoint(tmp_path / "bad.pt")
    assert "\n" not in str(e.value)


def test_tokenizer_is_gpt2_and_prefix_vocab_stays_below_its_size():
    full = get_tokenizer(50257)
    assert full.encode("Hello world") == [15496, 995]
    assert full.eot_token == 50256
    text = shakespeare()[1][:20000]
    assert full.decode(full.encode_ordinary(text)) == text
    small = get_tokenizer(2048)
    ids = small.encode_ordinary(text)
    assert small.decode(ids) == text and max(ids) < 2047 and small.eot_token == 2047
    assert small.encode("<|endoftext|>", allowed_special="all") == [2047]
    assert [i for i in full.encode(" the") if i < 2047] == small.encode(" the")  # shared ids are GPT-2's


def test_shakespeare_is_plain_speaker_and_verse_text():
    train, val = shakespeare()
    assert "HAMLET:\n" in train + val and "**" not in train and "#" not in train
    assert len(val) > 0.08 * (len(train) + len(val))


def test_train_tiny_writes_a_nanogpt_checkpoint_that_generate_loads(tmp_path):
    from train_tiny import train

    trained = train(
        out_dir=str(tmp_path),
        device="cpu",
        max_iters=3,
        max_seconds=60,
        batch_size=2,
        block_size=32,
        vocab_size=300,
        n_layer=1,
        n_head=2,
        n_embd=16,
    )
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert {"model", "model_args", "optimizer", "iter_num", "best_val_loss", "config"} <= set(ckpt)
    assert ckpt["iter_num"] == 3 and ckpt["model_args"]["block_size"] == 32
    loaded = load_checkpoint(tmp_path / "ckpt.pt")
    idx = torch.randint(0, 300, (1, 32))
    assert torch.equal(loaded(idx)[0], trained.eval()(idx)[0])
