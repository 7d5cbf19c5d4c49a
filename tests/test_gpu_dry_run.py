"""bench/gpu.py --dry-run: every section of the GPU benchmark runs on the CPU at a tiny shape, through the same
driver (a process for each section) and the same code as on a GPU but for the calls only CUDA has, so that a GPU
lease spends its minutes measuring, not finding an import or a call that no longer works. About a minute on 2
cores."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# one thread each: the driver's and its sections' OpenMP threads on 2 shared cores would spin against each other
ENV = dict(os.environ, OMP_NUM_THREADS="1")

TABLES = {  # section -> lines of the tables it prints: their headers, and rows it must have
    "tests": ["$ python -m pytest", " passed"],
    "hf_equal": [
        "ours: float32 greedy, 3 prompts of 4-24 tokens, up to 8 new: 3/3 equal to HF's",
        "ours, flex in every bucket: float32 greedy, 3 prompts of 4-24 tokens, up to 8 new: 3/3 equal to HF's",
    ],
    "e2e": ["| system | tok/s", "| ours |", "| HF static |", "| HF dynamic |", "| steps | count | ms |"],
    "best": ["every prompt 8 tokens, 6 new", "| ours |", "| HF static |"],
    "large": ["(3 x 48, random weights)", "| ours |", "| HF static |"],
    "candidates": [
        "| system | tok/s",
        "| ours |",
        "| ours, prompt chunks padded |",
        "| ours, flex in every bucket |",
    ],
    "attention": ["| B | L | gather_attend (compiled) |", "| 3 | 64 |"],
    "profile": ["### ours: ", "### HF static: ", "Self CPU time total"],
    "step": ["| B | L | shape | eager ms |", "| 3 | 40 | (3, 4) |"],
    "host": ["| device | run | ms a step |", "| cpu | 2 |"],
}


def gpu_bench(*args, timeout=300):
    cmd = [sys.executable, "bench/gpu.py", "--dry-run", *args]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


def test_gpu_bench_dry_run_runs_every_section_and_prints_each_table(tmp_path):
    code, out, err = gpu_bench("--out", str(tmp_path))
    assert code == 0, out[-4000:] + err[-4000:]
    assert "Traceback" not in out + err
    for section, lines in TABLES.items():
        text = (tmp_path / f"{section}.md").read_text()  # written as measured: what a GPU lease brings back
        for line in lines:
            assert line in text and line in out, (section, line)
        assert f"\n{section}: done in" in text
        assert f"\n{section}: done (" in out  # the driver's summary
    candidates = (tmp_path / "candidates.md").read_text()
    assert candidates.count("the same tokens as ours in 6 of 6 requests") == 3  # the defaults and two other settings
    assert "to run again" not in out


def test_gpu_bench_skips_a_section_its_budget_cannot_hold_and_names_it_to_run_again(tmp_path):
    """With 25 s for two sections, 20 of them kept for the second, the first has 5 s: too few to start."""
    code, out, err = gpu_bench(
        "--sections", "step,host", "--budget-s", "25", "--reserve-s", "20", "--out", str(tmp_path)
    )
    assert code == 1, out[-4000:] + err[-4000:]
    assert "step: skipped" in out and "host: done" in out
    assert "to run again: python3 bench/gpu.py --sections step --out DIR" in out
    assert not (tmp_path / "step.md").exists() and (tmp_path / "host.md").exists()
