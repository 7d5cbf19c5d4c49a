"""The command line (generate.py) a newcomer meets: one-line errors for bad flags, prompts and checkpoints,
what a plain run prints and writes (--json, --pool-map), samples and beams, padded vocabularies, Ctrl-C.
Experiments run through it (--compare under a budget, --sweep-rates) are test_experiments.py's."""

import json
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_gpt
from test_model import save_nanogpt_ckpt

import generate
from engine import Engine
from harness.checkpoints import load_checkpoint
from model import GPT, GPTConfig
from scheduler import PagedEngine


def one_line_error(argv):
    """Run the CLI; it must exit non-zero with one 'error: ...' line and no traceback (any other
    exception would fail the test here)."""
    with pytest.raises(SystemExit) as e:
        generate.main(argv)
    assert isinstance(e.value.code, str) and e.value.code.startswith("error: ") and "\n" not in e.value.code
    return e.value.code


def one_second_steps(monkeypatch):
    """The CLI's meters read a clock that only the engines' steps move, each by a second."""
    clock = SimpleNamespace(t=0.0)
    monkeypatch.setattr("harness.metrics.WALL_CLOCK", SimpleNamespace(now=lambda: clock.t, sleep=None))
    step = Engine.step

    def timed_step(self):
        clock.t += 1.0
        return step(self)

    monkeypatch.setattr(Engine, "step", timed_step)


def broken_checkpoints(tmp_path):
    good = tiny_gpt(dtype=torch.float32)
    state, args = good.state_dict(), vars(good.config)
    cases = {"empty.pt": b"", "text.pt": b"hello, I am a text file\n"}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
    torch.save({"model": state, "model_args": {**args, "n_head": 5}}, tmp_path / "heads.pt")
    torch.save({"model": state, "model_args": {k: v for k, v in args.items() if k != "n_head"}}, tmp_path / "keys.pt")
    torch.save({"model": state, "model_args": {**args, "vocab_size": 301}}, tmp_path / "shape.pt")
    torch.save(
        {"model": {k: v for k, v in state.items() if "ln_f" not in k}, "model_args": args}, tmp_path / "missing.pt"
    )
    small = GPT(GPTConfig(block_size=64, vocab_size=100, n_layer=1, n_head=2, n_embd=16))
    torch.save({"model": small.state_dict(), "model_args": vars(small.config)}, tmp_path / "vocab.pt")
    return [
        ("empty.pt", "not a PyTorch checkpoint"),
        ("text.pt", "not a PyTorch checkpoint"),
        ("heads.pt", "n_embd 32 is not a multiple of n_head 5"),
        ("keys.pt", "model_args lack n_head"),
        ("shape.pt", "size mismatch for transformer.wte.weight: copying a param with shape torch.Size([300, 32])"),
        ("missing.pt", '"transformer.ln_f.weight"'),
        ("vocab.pt", "vocab_size 100 is below 257"),
    ]


def test_broken_checkpoints_are_one_line_errors_naming_the_cause(tmp_path):
    for name, message in broken_checkpoints(tmp_path):
        assert message in one_line_error(["--ckpt", str(tmp_path / name)]), name


def test_cli_bad_checkpoint_and_empty_prompts_file(tmp_path, ckpt):
    (tmp_path / "bad.pt").write_text("garbage")
    (tmp_path / "empty.txt").write_text("\n\n")
    for argv, message in [
        (["--ckpt", str(tmp_path / "bad.pt")], "cannot read checkpoint"),
        (["--ckpt", str(tmp_path / "none.pt")], "no checkpoint at"),
        (["--ckpt", ckpt, "--prompts", str(tmp_path / "empty.txt")], "holds no prompt"),
    ]:
        with pytest.raises(SystemExit) as e:
            generate.main(argv)
        assert e.value.code.startswith("error: ") and message in e.value.code


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
        (["--device", "mps"], "--device mps: this engine runs on cpu or cuda"),
        (["--device", "cpu:1"], "--device cpu:1: cpu takes no index"),
        (["--paged", "--num-blocks", "100000000"], "GiB free: lower --num-blocks or --block-size"),
        (["--paged", "--json", "."], "--json .: a folder; name the file to write"),
        (["--paged", "--request-rate", "1e-6"], "a run's arrivals last at most an hour"),
        pytest.param(
            ["--device", "cuda"],
            "sees no CUDA GPU",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="has CUDA"),
        ),
    ],
)
def test_cli_bad_input_is_one_line_error(ckpt, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        generate.main(["--ckpt", ckpt, "--max-new-tokens", "8", *argv])
    assert isinstance(e.value.code, str) and e.value.code.startswith("error: ") and "\n" not in e.value.code
    assert message in e.value.code


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--num-requests", "2", "--prompt-len", "10000000:10000000"], "do not fit in the"),
        (
            ["--num-requests", "2", "--shared-prefix", "10000000"],
            "--shared-prefix 10000000 must be shorter than the --prompt-len maximum 128",
        ),
        (["--num-requests", "2", "--shared-prefix", "200"], "must be shorter than the --prompt-len maximum 128"),
        (  # /dev/null is no folder, even for root: no folder can be made under it
            ["--json", "/dev/null/out/run.json"],
            "--json /dev/null/out/run.json: cannot make the folder /dev/null/out: Not a directory",
        ),
        (["--plot", "/dev/null/out/p.png"], "cannot make the folder /dev/null/out"),
        (["--plot", "out.xyz"], "--plot out.xyz: the file name must end in one of"),
        (["--temperature", "nan"], "--temperature: nan is not a finite number"),
        (["--temperature", "inf"], "--temperature: inf is not a finite number"),
        (["--num-requests", "4", "--max-new-tokens", "9"], "--max-new-tokens is for your own prompts"),
        (["--request-rate", "0"], "--request-rate: 0 must be above 0"),
        (["--request-rate", "-2"], "--request-rate: -2 must be above 0"),
        (["--sweep-rates", "1,2"], "--sweep-rates needs --compare"),
        (["--compare", "--sweep-rates", "1,0"], "--sweep-rates: 0 must be above 0"),
        (["--reserve", "pow2"], "--reserve needs --kv-budget"),
        (["--paged", "--kv-budget", "8"], "--kv-budget 8 slots hold no block of --block-size 16"),
        # flags that only the paged engine, or only a drawn workload, reads: refused where nothing would read them
        (["--num-blocks", "8"], "--num-blocks needs --paged or --compare"),
        (["--block-size", "8"], "--block-size needs --paged or --compare"),
        (["--token-budget", "64"], "--token-budget needs --paged or --compare"),
        (["--compile", "on"], "--compile on needs --paged or --compare"),
        (["--paged", "--kv-budget", "64", "--reserve", "pow2"], "--reserve needs the contiguous baseline"),
        (["--prompt-len", "8:16"], "--prompt-len needs a drawn workload"),
        (["--paged", "--prompt", "ROMEO:", "--shared-prefix", "2"], "--shared-prefix needs a drawn workload"),
        (["--num-requests", "2", "--prompt", "ROMEO:"], "--prompt needs no --num-requests"),
        (
            ["--kv-budget", "32", "--num-requests", "3", "--prompt-len", "20:30", "--new-tokens", "8:8"],
            "reserves 64 slots under --reserve max, but the KV budget is 32 slots",
        ),
        (
            ["--paged", "--kv-budget", "32", "--num-requests", "3", "--prompt-len", "30:30", "--new-tokens", "8:8"],
            "needs 3 blocks of 16, but the pool has only 2",
        ),
        (
            [
                "--compare",
                "--kv-budget",
                "32",
                "--reserve",
                "oracle",
                "--num-requests",
                "2",
                "--prompt-len",
                "30:30",
                "--new-tokens",
                "8:8",
            ],
            "reserves 64 slots under --reserve max",
        ),
    ],
)
def test_bad_workload_output_and_budget_flags_are_one_line_errors(ckpt, argv, message):
    assert message in one_line_error(["--ckpt", ckpt, *argv])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--num-beams", "2", "--temperature", "0.8"], "--num-beams 2 is greedy beam search"),
        (["--num-beams", "2", "--top-k", "5"], "--num-beams 2 is greedy beam search"),
        (["--num-beams", "2", "--num-samples", "3"], "--num-beams 2 is greedy beam search"),
        (["--num-beams", "2", "--top-p", "0.9"], "it takes no --num-samples, --temperature, --top-k, --top-p, --min-p"),
        (["--num-beams", "2", "--logprobs", "1", "--paged"], "--num-beams 2 is greedy beam search, scored per beam"),
        (["--top-p", "0"], "argument --top-p: 0 must be above 0"),
        (["--top-p", "1.5"], "--top-p 1.5 and --min-p 0.0 must be at most 1"),
        (["--min-p", "-0.1"], "argument --min-p: -0.1 is below 0.0"),
        (["--min-p", "2"], "--min-p 2.0 must be at most 1"),
        (["--logprobs", "21", "--paged"], "--logprobs 21 must be at most 20"),
        (["--logprobs", "3"], "--logprobs needs --paged"),
        (["--early-stopping", "true"], "--early-stopping needs --num-beams"),
        (["--num-beams", "0"], "argument --num-beams: 0 is below 1"),
        (["--num-samples", "0"], "argument --num-samples: 0 is below 1"),
        (["--length-penalty", "0.5"], "--length-penalty needs --num-beams"),
        (
            ["--num-beams", "9", "--max-batch", "8", "--paged", "--max-new-tokens", "9"],
            "9 sequences of one request exceed the 8 that run at once",
        ),
        (
            ["--num-beams", "4", "--paged", "--num-blocks", "10", "--block-size", "4", "--max-new-tokens", "20"],
            "needs 28 blocks of 4, but the pool has only 10",
        ),
    ],
)
def test_bad_sample_and_beam_flags_are_one_line_errors(ckpt, argv, message):
    assert message in one_line_error(["--ckpt", ckpt, "--prompt", "ROMEO:"] + argv)


def test_non_utf8_prompts_file_is_a_one_line_error(ckpt, tmp_path):
    (tmp_path / "latin1.txt").write_bytes("ROMEO:\ncaf\xe9\n".encode("latin-1"))
    assert "is not UTF-8 text: invalid continuation byte at byte 10" in one_line_error(
        ["--ckpt", ckpt, "--prompts", str(tmp_path / "latin1.txt")]
    )


def test_tiny_temperature_behaves_as_greedy(ckpt, tmp_path):
    outputs = []
    for temperature in ["0", "1e-45"]:
        generate.main(
            ["--ckpt", ckpt, "--max-new-tokens", "20", "--temperature", temperature, "--json", str(tmp_path / "t.json")]
        )
        outputs.append([r["output_tokens"] for r in json.loads((tmp_path / "t.json").read_text())["requests"]])
    assert outputs[0] == outputs[1]


def padded_vocab_checkpoint(path):
    """A 50,304-id GPT whose likeliest ids are the 47 padding ids past GPT-2's 50,257 tokens."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=50304, n_layer=1, n_head=2, n_embd=16)).eval()
    with torch.no_grad():
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.fill_(1.0)  # every position's final vector is all ones
        model.lm_head.weight[50257:] = 1.0  # so ids 50,257+ get logit 16, the rest about 0
    save_nanogpt_ckpt(model, path)


@pytest.mark.parametrize(
    "flags", [["--temperature", "0"], ["--temperature", "1.0"], ["--temperature", "1.0", "--top-k", "60"]]
)
def test_padded_vocabulary_ids_are_never_sampled(tmp_path, flags):
    padded_vocab_checkpoint(tmp_path / "gpt2.pt")
    for engine in [[], ["--paged"]]:
        generate.main(
            [
                "--ckpt",
                str(tmp_path / "gpt2.pt"),
                "--max-new-tokens",
                "30",
                "--json",
                str(tmp_path / "o.json"),
                *flags,
                *engine,
            ]
        )
        requests = json.loads((tmp_path / "o.json").read_text())["requests"]
        assert len(requests) == 4 and all(
            len(r["output_tokens"]) == 30 and max(r["output_tokens"]) < 50257 for r in requests
        )


def test_ctrl_c_exits_with_one_line_and_keeps_finished_requests(ckpt, tmp_path, monkeypatch):
    real_step, calls = PagedEngine.step, []

    def step_then_interrupt(self):
        calls.append(1)
        if len(calls) == 40:
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(PagedEngine, "step", step_then_interrupt)
    out = tmp_path / "partial.json"
    message = one_line_error(
        [
            "--ckpt",
            ckpt,
            "--paged",
            "--num-requests",
            "40",
            "--prompt-len",
            "4:8",
            "--new-tokens",
            "1:30",
            "--max-batch",
            "8",
            "--json",
            str(out),
        ]
    )
    data = json.loads(out.read_text())
    assert data["interrupted"] and 0 < len(data["requests"]) < 40
    assert f"interrupted: {len(data['requests'])} of 40 requests of this run had finished" in message
    assert all(len(r["output_tokens"]) > 0 for r in data["requests"])


def test_plain_run_prints_completions_and_one_summary_line_and_help_shows_defaults(ckpt, capsys):
    generate.main(["--ckpt", ckpt, "--paged", "--max-new-tokens", "5"])
    out = capsys.readouterr().out
    assert (
        out.count("--- request") == 4
        and "--- paged + prefix cache: 20 new tokens in" in out
        and "kv_waste_pct" not in out
    )
    generate.main(["--ckpt", ckpt, "--paged", "--max-new-tokens", "5", "--metrics"])
    assert "kv_waste_pct" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        generate.main(["--help"])
    help_text = capsys.readouterr().out
    assert (
        "(default: 0.8)" in help_text and "(default: 512; on CUDA 4096)" in help_text and "(default: inf)" in help_text
    )


def test_cli_json_holds_requests_in_order_and_metrics(ckpt, tmp_path, monkeypatch):
    """Two prompts of two greedy samples, 10 tokens each, all at once, on a clock that only a step moves, by a
    second: every sequence takes its first token in step 1 and its last in step 10."""
    one_second_steps(monkeypatch)
    out = tmp_path / "run.json"
    for paged in [[], ["--paged"]]:
        generate.main(
            [
                "--ckpt",
                ckpt,
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
        data = json.loads(out.read_text(), parse_constant=lambda name: pytest.fail(f"{name} is not standard JSON"))
        assert data["metrics"]["request_rate"] == "inf"  # all at once: standard JSON has no infinity
        assert [r["prompt"] for r in data["requests"]] == ["ROMEO:", "To be, or not"]  # samples: one entry each
        assert all(len(r["sequences"]) == 2 for r in data["requests"])
        assert all(len(s["output_tokens"]) == 10 for r in data["requests"] for s in r["sequences"])
        prompt_lens = [len(r["prompt_tokens"]) for r in data["requests"]]
        want = dict(
            output_tokens=2 * 2 * 10,
            wall_s=10,
            output_tok_s=40 / 10,
            ttft_ms_mean=1000,
            ttft_ms_p90=1000,
            tpot_ms_mean=(10_000 - 1000) / 9,
            steps=10,
            prefill_tokens=sum(prompt_lens),  # once for both samples
        )
        if paged:
            # ROMEO: is 6 tokens and To be, or not 11 (in a 300-id vocabulary): a sample of the first needs one
            # 16-slot block, of the second two, and the pool holds just that. The peak comes in step 7, where the
            # second's samples write position 16: 6 blocks, holding 6 + 6 and 16 + 1 tokens for each sample
            assert prompt_lens == [6, 11]
            used = 2 * (6 + 6) + 2 * (16 + 1)
            want.update(kv_slots_allocated_peak=6 * 16, kv_slots_used_peak=used, kv_waste_pct=100 * (96 - used) / 96)
            want.update(num_blocks=6, block_size=16, prefix_hit_rate=0, preemptions=0)
        else:
            greedy = [s["output_tokens"] for r in data["requests"] for s in r["sequences"]]
        assert {k: data["metrics"][k] for k in want} == pytest.approx(want)
    assert greedy == [s["output_tokens"] for r in data["requests"] for s in r["sequences"]]  # paged == contiguous


def test_num_samples_and_beams_print_and_write_every_sequence(ckpt, tmp_path, capsys):
    out = tmp_path / "s.json"
    generate.main(
        [
            "--ckpt",
            ckpt,
            "--paged",
            "--prompt",
            "ROMEO:",
            "--num-samples",
            "3",
            "--max-new-tokens",
            "6",
            "--json",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert text.count("--- request 0, sample") == 3 and "18 new tokens in" in text
    request = json.loads(out.read_text())["requests"][0]
    assert [s["seed"] for s in request["sequences"]] == [1337, 1338, 1339]
    assert request["output_tokens"] == request["sequences"][0]["output_tokens"]
    generate.main(["--ckpt", ckpt, "--paged", "--prompt", "ROMEO:", "--num-samples", "2", "--max-new-tokens", "4"]
                  + ["--logprobs", "1", "--json", str(out)])  # fmt: skip
    request = json.loads(out.read_text())["requests"][0]
    for s in request["sequences"]:  # each sample's own logprobs, the first's also the request's
        assert [x["id"] for x in s["logprobs"]] == s["output_tokens"]
    assert request["logprobs"] == request["sequences"][0]["logprobs"]
    generate.main(
        [
            "--ckpt",
            ckpt,
            "--paged",
            "--prompt",
            "ROMEO:",
            "--num-beams",
            "3",
            "--max-new-tokens",
            "6",
            "--length-penalty",
            "0.5",
            "--json",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert text.count("--- request 0, best of 3 beams (score") == 1 and "6 new tokens in" in text
    beams = json.loads(out.read_text())["requests"][0]["sequences"]
    assert len(beams) == 3 and [b["score"] for b in beams] == sorted((b["score"] for b in beams), reverse=True)
    contiguous = tmp_path / "c.json"
    generate.main(
        [
            "--ckpt",
            ckpt,
            "--prompt",
            "ROMEO:",
            "--num-beams",
            "3",
            "--max-new-tokens",
            "6",
            "--length-penalty",
            "0.5",
            "--json",
            str(contiguous),
        ]
    )
    assert json.loads(contiguous.read_text())["requests"][0]["sequences"] == beams


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compare_serves_the_users_own_prompts(ckpt, tmp_path, capsys, dtype):
    """Equal outputs in float32; in bf16, where the designs round differently, the table says why they part."""
    generate.main(
        [
            "--dtype",
            dtype,
            "--ckpt",
            ckpt,
            "--compare",
            "--prompt",
            "ROMEO:",
            "--max-new-tokens",
            "7",
            "--temperature",
            "0",
            "--json",
            str(tmp_path / "c.json"),
        ]
    )
    runs = json.loads((tmp_path / "c.json").read_text())["runs"]
    assert set(runs) == {"contiguous", "paged", "paged_prefix"}
    assert all(m["output_tokens"] == 7 for m in runs.values())
    note = "in bfloat16 the designs round differently"
    if dtype == "float32":
        assert runs["paged"]["same_output_pct"] == runs["paged_prefix"]["same_output_pct"] == 100
        assert runs["paged"]["same_prefix_pct"] == runs["paged_prefix"]["same_prefix_pct"] == 100
        assert note not in capsys.readouterr().out
    else:
        assert note in capsys.readouterr().out


def test_cli_pool_map_is_written_and_its_flag_checked_before_the_run(ckpt, tmp_path, capsys):
    path = tmp_path / "out" / "pool.png"  # a folder that does not exist yet is made, as for --plot and --json
    generate.main(["--ckpt", ckpt, "--paged", "--max-new-tokens", "6", "--pool-map", str(path)])
    assert path.read_bytes()[:4] == b"\x89PNG"
    assert f"pool map written to {path}" in capsys.readouterr().out
    for argv, message in [
        (["--pool-map", "p.png"], "--pool-map needs --paged, without --compare"),
        (["--paged", "--compare", "--pool-map", "p.png"], "--pool-map needs --paged, without --compare"),
        (["--paged", "--pool-map", "p.xyz"], "--pool-map p.xyz: the file name must end in one of"),
        (["--paged", "--pool-map", "/dev/null/p.png"], "--pool-map /dev/null/p.png: cannot make the folder /dev/null"),
    ]:
        assert message in one_line_error(["--ckpt", ckpt] + argv)


def test_logprobs_print_and_write_each_tokens_and_the_likeliest(ckpt, tmp_path, capsys):
    """--logprobs 2: each new token's line with its logprob and rank, and the JSON's entries, equal log_softmax of
    the model's logits over the whole sequence; --top-p and --min-p sample within what they keep."""
    out = tmp_path / "l.json"
    argv = ["--ckpt", ckpt, "--paged", "--prompt", "ROMEO:", "--max-new-tokens", "5", "--logprobs", "2"]
    generate.main([*argv, "--top-p", "0.9", "--min-p", "0.05", "--json", str(out)])
    text = capsys.readouterr().out
    assert "its tokens' logprobs (raw), each with its rank, then the 2 likeliest" in text
    request = json.loads(out.read_text())["requests"][0]
    model = load_checkpoint(ckpt)
    tokens = request["prompt_tokens"] + request["output_tokens"]
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor(tokens)[None])[0][0].double(), -1)
    assert [t["id"] for t in request["logprobs"]] == request["output_tokens"]
    for i, t in enumerate(request["logprobs"]):
        row = logprobs[len(request["prompt_tokens"]) + i - 1]
        assert t["logprob"] == pytest.approx(float(row[t["id"]]), abs=1e-5)
        assert abs(t["rank"] - int((row >= row[t["id"]]).sum())) <= 1  # float32 against float64: a tie may differ
        assert [x["id"] for x in t["top"]] == row.topk(2).indices.tolist()
        assert f"{t['logprob']:8.3f} (rank {t['rank']})" in text


def test_beams_that_stop_at_eos_print_their_hypotheses(ckpt, tmp_path, capsys):
    out = tmp_path / "b.json"
    argv = ["--ckpt", ckpt, "--paged", "--prompt", "ROMEO:", "--max-new-tokens", "12", "--num-beams", "3"]
    generate.main([*argv, "--stop-at-eos", "--early-stopping", "never", "--json", str(out)])
    beams = json.loads(out.read_text())["requests"][0]["sequences"]
    assert "best of 3 beams (score" in capsys.readouterr().out
    assert len(beams) == 3 and [b["score"] for b in beams] == sorted((b["score"] for b in beams), reverse=True)
