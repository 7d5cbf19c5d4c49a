"""The command line a newcomer meets: one-line errors, honest metrics, padded vocabularies, Ctrl-C."""

import json

import pytest
import torch
from conftest import run_engine, tiny_gpt
from test_model import save_nanogpt_ckpt

import generate
from contiguous import ContiguousEngine
from metrics import cell, metrics, percentile
from model import GPT, GPTConfig
from scheduler import PagedEngine
from sequence import Request


def one_line_error(argv):
    """Run the CLI; it must exit non-zero with one 'error: ...' line and no traceback (any other
    exception would fail the test here)."""
    with pytest.raises(SystemExit) as e:
        generate.main(argv)
    assert isinstance(e.value.code, str) and e.value.code.startswith("error: ") and "\n" not in e.value.code
    return e.value.code


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
        (["--kv-budget", "8"], "--kv-budget 8 slots hold no block of --block-size 16"),
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


def test_percentiles_interpolate_between_closest_ranks():
    assert percentile([10.0, 20.0], 90) == 19.0  # not the minimum, as int(0.9 * (n - 1)) gave
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([0.0, 100.0], 99) == 99.0 and percentile([7.0], 99) == 7.0


def test_waste_counts_only_last_block_tails_and_prompt_blocks_held_ahead_are_reported_apart(model):
    engine = PagedEngine(model, num_blocks=8, block_size=4, token_budget=4)
    run_engine(engine, [Request(list(range(1, 11)), 3)])  # 10 prompt tokens in 3 blocks, 4 per step
    # (allocated, used, ahead): the prompt's 3 blocks are allocated at admission, filled 4 tokens a step
    assert [(s["allocated"], s["used"], s["ahead"]) for s in engine.meter.steps] == [
        (12, 4, 8),
        (12, 8, 4),
        (12, 10, 0),
        (12, 11, 0),
        (12, 12, 0),
    ]
    m = metrics(engine.meter, 1.0, float("inf"), None)
    assert m["kv_waste_pct"] == 0.0 and m["kv_ahead_pct"] == pytest.approx(100 * 8 / 12)
    steady = PagedEngine(model, num_blocks=8, block_size=4, token_budget=64)
    run_engine(steady, [Request(list(range(1, 11)), 1)])  # one step: 10 tokens in 12 slots
    assert metrics(steady.meter, 1.0, float("inf"), None)["kv_waste_pct"] == pytest.approx(100 * 2 / 12)


def test_tpot_is_not_applicable_when_every_request_makes_one_token(model):
    engine = ContiguousEngine(model)
    run_engine(engine, [Request([1, 2, 3], 1), Request([4, 5], 1)])
    m = metrics(engine.meter, 1.0, float("inf"), None)
    assert m["tpot_ms_mean"] is None and m["prefix_hit_rate"] is None
    assert cell(None) == "—" and cell(31050.4) == "31,050" and cell(0.123) == "0.12"


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


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--num-beams", "2", "--temperature", "0.8"], "--num-beams 2 is greedy beam search"),
        (["--num-beams", "2", "--top-k", "5"], "--num-beams 2 is greedy beam search"),
        (["--num-beams", "2", "--num-samples", "3"], "--num-beams 2 is greedy beam search"),
        (["--num-beams", "0"], "argument --num-beams: 0 is below 1"),
        (["--num-samples", "0"], "argument --num-samples: 0 is below 1"),
        (["--length-penalty", "0.5"], "--length-penalty needs --num-beams"),
        (
            ["--num-beams", "9", "--max-batch", "8", "--paged", "--max-new-tokens", "9"],
            "9 sequences of one request exceed the 8 that run at once",
        ),
        (
            ["--num-beams", "4", "--paged", "--num-blocks", "10", "--block-size", "4", "--max-new-tokens", "20"],
            "needs 7 blocks of 4 for each of 4 beams, but the pool has only 10",
        ),
    ],
)
def test_bad_sample_and_beam_flags_are_one_line_errors(ckpt, argv, message):
    assert message in one_line_error(["--ckpt", ckpt, "--prompt", "ROMEO:"] + argv)


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


def test_agreement_is_the_share_of_an_output_identical_before_its_first_difference():
    assert generate.agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert generate.agreement([1, 2, 9, 4], [1, 2, 3, 4]) == 0.5
    assert generate.agreement([5, 2], [1, 2]) == 0.0
    assert generate.agreement([1, 2], [1, 2, 3, 4]) == 0.5  # one stopped early (eos): the rest differs
    assert generate.agreement([], []) == 1.0
