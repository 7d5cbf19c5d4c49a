"""The tiny GPT, its checkpoints, the tokenizer, sampling and the CLI's errors."""

import json

import pytest
import torch
from conftest import baseline, make_requests, run_engine, tiny_gpt

import generate
from checkpoints import get_tokenizer, load_checkpoint, shakespeare
from contiguous import ContiguousBatch, ContiguousEngine
from engine import PlanEntry, Sampler
from model import GPT, GPTConfig
from paged import PagedBatch
from prepack import Linear
from sampling import sample, uniform
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
    block_tables = torch.tensor([[i + 8 * j for j in range(8)] for i in range(len(prompts))], dtype=torch.int32)

    def paged_batch(plan, samplers):
        return PagedBatch(plan, samplers, k_pool, v_pool, block_tables, compiled="compiled" in cache)

    make_batch = (
        paged_batch
        if cache.startswith("paged")
        else (lambda plan, samplers: ContiguousBatch(plan, samplers, torch.device("cpu")))
    )
    reqs, steps = incremental_logits(model, prompts, 6, make_batch)
    with torch.no_grad():
        for i, r in enumerate(reqs):
            full, _ = model(torch.tensor(r.tokens[:-1])[None])  # (1, T, V), no cache
            for step, logits in enumerate(steps):
                pos = len(prompts[i]) - 1 + step
                torch.testing.assert_close(logits[i], full[0, pos], rtol=0, atol=1e-10)


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


@pytest.mark.parametrize("temperature, top_k", [(1.0, None), (0.8, 20)])
def test_seeded_sample_is_the_same_alone_and_in_a_batch(model, temperature, top_k):
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9], [3, 2]]
    news = [12, 20, 5, 16]
    together = run_engine(ContiguousEngine(model, max_batch=4), make_requests(prompts, news, temperature, top_k))
    for i in range(len(prompts)):
        alone = run_engine(ContiguousEngine(model, max_batch=1), [make_requests(prompts, news, temperature, top_k)[i]])
        assert together[i] == alone[0]
    assert together != baseline(model, prompts, news)  # sampling really sampled: not the greedy output


def test_sampler_draws_each_token_with_its_softmax_probability_and_top_k_cuts_the_tail():
    n = 20000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]]).expand(n, 5).contiguous()
    position, seed, ones = torch.arange(n), torch.full((n,), 7), torch.ones(n)
    for temperature, top_k in [(1.0, 0), (0.5, 0), (1.0, 3)]:
        want = (logits[0, : top_k or 5] / temperature).softmax(-1)
        got = sample(logits, ones * temperature, torch.full((n,), top_k), seed, position, top_k, top_k == 0)
        freq = torch.bincount(got, minlength=5).double() / n
        assert torch.all(freq[len(want) :] == 0) and torch.allclose(freq[: len(want)], want.double(), atol=0.012), (
            freq,
            want,
        )
    alone = sample(logits, ones, torch.zeros(n, dtype=torch.long), seed, position)
    assert torch.equal(alone, sample(logits, ones, torch.zeros(n, dtype=torch.long), seed, position))  # a pure function
    assert not torch.equal(alone, sample(logits, ones, torch.zeros(n, dtype=torch.long), seed + 1, position))
    # rows that keep every id, rows that cut, and greedy rows in one batch: each draws as it does alone
    mixed_k, mixed_t = torch.tensor([0, 3, 0] * (n // 3)), torch.tensor([1.0, 1.0, 0.0] * (n // 3))
    cut = sample(logits, ones, torch.full((n,), 3), seed, position, 3, False)
    mixed = sample(logits[: len(mixed_k)], mixed_t, mixed_k, seed[: len(mixed_k)], position[: len(mixed_k)], 3, True)
    assert torch.equal(mixed[0::3], alone[0 : len(mixed_k) : 3]) and torch.equal(mixed[1::3], cut[1 : len(mixed_k) : 3])
    assert torch.all(mixed[2::3] == 0)
    u = uniform(
        torch.arange(1000).repeat_interleave(100), torch.arange(100).repeat(1000)
    )  # 1,000 seeds x 100 positions
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002
    assert len(u.unique()) > 99_000  # seeds and positions both change the draw


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "ckpt.pt"
    save_nanogpt_ckpt(tiny_gpt(dtype=torch.float32), path)
    return str(path)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt", ""], "empty prompt"),
        (["--prompt", "Hi", "--max-new-tokens", "70"], "= 72 exceeds the model's context of 64"),
        (["--temperature", "-0.5"], "--temperature: -0.5 is below 0"),
        (["--top-k", "0"], "--top-k: 0 is below 1"),
        (["--paged", "--block-size", "0"], "--block-size: 0 is below 1"),
        (["--paged", "--token-budget", "0"], "--token-budget: 0 is below 1"),
        (["--paged", "--num-blocks", "1", "--block-size", "4", "--max-new-tokens", "20"], "but the pool has only 1"),
        (["--prompts", "/no/such/file"], "cannot read --prompts file"),
        pytest.param(
            ["--device", "cuda"],
            "sees no CUDA GPU",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="has CUDA"),
        ),
    ],
)
def test_cli_bad_input_is_one_line_error(tiny_ckpt, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        generate.main(["--ckpt", tiny_ckpt, "--max-new-tokens", "8", *argv])
    assert isinstance(e.value.code, str) and e.value.code.startswith("error: ") and "\n" not in e.value.code
    assert message in e.value.code


def test_cli_bad_checkpoint_and_empty_prompts_file(tmp_path, tiny_ckpt):
    (tmp_path / "bad.pt").write_text("garbage")
    (tmp_path / "empty.txt").write_text("\n\n")
    for argv, message in [
        (["--ckpt", str(tmp_path / "bad.pt")], "cannot read checkpoint"),
        (["--ckpt", str(tmp_path / "none.pt")], "no checkpoint at"),
        (["--ckpt", tiny_ckpt, "--prompts", str(tmp_path / "empty.txt")], "holds no prompt"),
    ]:
        with pytest.raises(SystemExit) as e:
            generate.main(argv)
        assert e.value.code.startswith("error: ") and message in e.value.code


def test_cli_json_holds_requests_in_order_and_metrics(tiny_ckpt, tmp_path):
    out = tmp_path / "run.json"
    for paged in [[], ["--paged"]]:
        generate.main(
            [
                "--ckpt",
                tiny_ckpt,
                "--prompt",
                "ROMEO:",
                "--prompt",
                "To be, or not",
                "--num-samples",
                "2",
                "--max-new-tokens",
                "10",
                "--temperature",
                "0",
                "--json",
                str(out),
                *paged,
            ]
        )
        data = json.loads(out.read_text())
        assert [r["prompt"] for r in data["requests"]] == ["ROMEO:", "To be, or not"]  # samples: one entry each
        assert all(len(r["sequences"]) == 2 for r in data["requests"])
        assert all(len(s["output_tokens"]) == 10 for r in data["requests"] for s in r["sequences"])
        for key in [
            "output_tokens",
            "wall_s",
            "output_tok_s",
            "ttft_ms_mean",
            "ttft_ms_p90",
            "tpot_ms_mean",
            "steps",
            "prefill_tokens",
        ]:
            assert key in data["metrics"]
        if paged:
            for key in [
                "kv_slots_allocated_peak",
                "kv_slots_used_peak",
                "kv_waste_pct",
                "num_blocks",
                "block_size",
                "prefix_hit_rate",
                "preemptions",
            ]:
                assert key in data["metrics"]
        else:
            greedy = [s["output_tokens"] for r in data["requests"] for s in r["sequences"]]
    assert greedy == [s["output_tokens"] for r in data["requests"] for s in r["sequences"]]  # paged == contiguous


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


def test_engines_prepack_the_callers_model_and_never_serve_a_stale_packed_weight():
    """A float32 model handed to either engine comes out with every Linear packed (as generate.py's load_model
    packs it), gives an unpacked copy's greedy tokens, and a weight changed after the engine was built is
    multiplied as it is now: its packed copy, made from the old version, is skipped."""
    prompts, news = [[5, 6, 7, 8, 9], list(range(1, 20)), [42], [3, 1, 4, 1, 5, 9]], [12, 8, 16, 10]

    def unpacked_tokens(model):  # a fresh model with model's weights, whose Linears all take F.linear
        fresh = tiny_gpt(dtype=torch.float32)
        fresh.load_state_dict(model.state_dict())
        engine = ContiguousEngine(fresh)
        for m in fresh.modules():
            if isinstance(m, Linear):
                m.packed_version = None  # Linear.forward multiplies the packed copy only if its version matches
        return run_engine(engine, make_requests(prompts, news))

    for make in (lambda model: PagedEngine(model, num_blocks=40, block_size=4), ContiguousEngine):
        model = tiny_gpt(seed=5, dtype=torch.float32)
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        assert linears and all(m.packed_version is None for m in linears)
        before, after = make(model), make(model)  # after runs once the weight changed: its prefix cache is empty
        assert all(m.packed_version == m.weight._version for m in linears), "the engine did not prepack its model"
        want = unpacked_tokens(model)
        assert run_engine(before, make_requests(prompts, news)) == want
        c_fc = model.transformer.h[0].mlp.c_fc
        with torch.no_grad():
            c_fc.weight.mul_(-3.0)  # a change after the engines were built
        assert c_fc.packed_version != c_fc.weight._version
        changed = unpacked_tokens(model)
        assert changed != want, "the change does not show in the tokens"
        assert run_engine(after, make_requests(prompts, news)) == changed
