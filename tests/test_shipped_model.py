"""The tiny Shakespeare model that ships in models/: what the first `python generate.py --paged` runs."""

import os
import subprocess
import sys

import torch

import generate
from harness import checkpoints
from harness.checkpoints import get_tokenizer, load_checkpoint, shakespeare


def test_shipped_model_holds_its_val_loss_on_the_held_out_plays():
    """Every whole 256-token window of the held-out split (each play's last tenth), not a random sample."""
    model = load_checkpoint(checkpoints.SHIPPED)
    assert model.config.vocab_size == 2048 and sum(p.numel() for p in model.parameters()) < 1.2e6
    val = torch.tensor(get_tokenizer(model.config.vocab_size).encode_ordinary(shakespeare()[1]))
    T = model.config.block_size
    n = (len(val) - 1) // T
    x, y = val[: n * T].view(n, T), val[1 : n * T + 1].view(n, T)
    with torch.no_grad():
        loss = sum(model(x[i : i + 64], y[i : i + 64])[1].item() * len(x[i : i + 64]) for i in range(0, n, 64)) / n
    assert n > 700 and loss <= 3.65, loss


def test_first_run_serves_the_shipped_model(capsys):
    generate.main(["--paged", "--max-new-tokens", "20"])
    out = capsys.readouterr().out
    assert out.count("--- request") == 4 and "ROMEO:" in out and "paged + prefix cache: 80 new tokens" in out


def test_example_drives_the_engine_from_python_with_the_baselines_greedy_tokens():
    """example.py, the README's Python example as a file, runs as a user runs it; its greedy request prints what
    the contiguous baseline generates for the same prompt, and it prints every request and sample."""
    from harness.contiguous import ContiguousEngine
    from sequence import Request

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run(
        [sys.executable, "example.py"], cwd=root, capture_output=True, text=True, timeout=300, check=False
    )
    assert run.returncode == 0, run.stderr[-2000:]
    model = load_checkpoint(checkpoints.SHIPPED)
    enc = get_tokenizer(model.config.vocab_size)
    greedy = Request(enc.encode("ROMEO:\n"), 48)
    ContiguousEngine(model).run([greedy])
    assert run.stdout.count("--- ") == 4
    assert enc.decode(greedy.prompt + greedy.generated) in run.stdout
