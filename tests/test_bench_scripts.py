"""Every script in bench/ runs as a user runs it, `python bench/X.py ...` in a process of its own: its smallest real
run where one takes seconds on a CPU, else --help (for a script that needs a GPU, vLLM or minutes of compiling);
and each imports as a module with bench/ first on sys.path, as the before-stop hook imports them. A script that
imports a name the engine no longer has, or calls it the old way, fails here. The runs' figures mean nothing.
Every command of docs/regenerate.sh parses with today's flags."""

import json
import os
import subprocess
import sys

import pytest
import torch
from test_readme_commands import words

import generate
from bench import compile_cpu, floor, fork_memory, sampling

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
# one thread each: two processes' OpenMP threads on 2 shared cores spin against each other (10-20x slower steps)
ENV = dict(os.environ, OMP_NUM_THREADS="1")

# script: (the arguments of its smallest run, where {tmp} is a fresh folder; a line its output holds)
RUNS = {
    "async_step.py": (["--num-requests", "6"], "the same tokens in 6 of 6 requests"),
    "bf16_quality.py": (["--num-prompts", "2"], "ours  bf16 against its float32"),
    "compile_cpu.py": (["--help"], "--rows ROWS"),  # 12-layer models, compiled: minutes
    "decode_attention.py": (["--help"], "--contexts CONTEXTS"),  # five paths compiled, and the C kernel
    "floor.py": (["--repeats", "1", "--num-requests", "4"], "sample() per step, sampled"),
    "fork_memory.py": (
        ["--num-requests", "2", "--prompt-len", "8:16", "--new-tokens", "4:8", "--plot", "{tmp}/fork.png"],
        "plot written to",
    ),
    "gemm_bound.py": (["--help"], "the output of bench/vllm_compare.py"),  # 4096^3 GEMMs
    "gpu.py": (["--help"], "--sections SECTIONS"),  # CUDA only
    "hf_compare.py": (["--repeats", "1", "--num-prompts", "2", "--rows", "equal", "--ckpt", "{tmp}/gpt2.pt"], "yes"),
    "host_step.py": (["--repeats", "1", "--num-requests", "8"], "host side a step"),
    "sampling.py": (
        ["--repeats", "1", "--shapes", "tiny", "--num-requests", "4", "--new-tokens", "8", "--compile", "kernel"]
        + ["--logit-scale", "14"],
        "logprobs: the same sampled outputs as top-k's: 4/4",
    ),
    "profile_compare.py": (
        ["--ours-only", "--num-requests", "4", "--workloads", "tiny/decode", "--top", "2"],
        "host side",
    ),
    "scoring.py": (["--smoke"], "< 1e-4: yes"),  # 8 questions, 2,000 held-out tokens; vLLM only with --vllm-python
    "speculation.py": (
        ["--repeats", "1", "--batches", "1", "--ks", "2", "--hf-ks", "", "--new-tokens", "16"],
        "| True |",
    ),
    "vllm_compare.py": (["--help"], "--vllm-python VLLM_PYTHON"),  # vLLM; its worker of ours runs below
}


def run(args, timeout=300):
    """`python ARGS` from the repository's root -> its output; it must exit 0."""
    cmd = [sys.executable, *args]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"python {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_every_bench_script_has_a_run_here():
    assert sorted(RUNS) == sorted(name for name in os.listdir(BENCH) if name.endswith(".py"))


@pytest.mark.parametrize("script", sorted(RUNS))
def test_bench_script_runs(script, tmp_path):
    args, expected = RUNS[script]
    out = run([os.path.join("bench", script), *(a.replace("{tmp}", str(tmp_path)) for a in args)])
    assert expected in out, out[-3000:]


def test_every_bench_script_imports_as_a_module():
    """As the before-stop hook imports each: runpy with bench/ first on sys.path and run_name "imported" (no main),
    each after the repository's modules an earlier one imported are forgotten, and sys.path is as it started."""
    code = f"""
import runpy, sys
sys.path[0] = "bench"
start = list(sys.path)
for script in sys.argv[1:]:
    for name, module in list(sys.modules.items()):  # torch stays imported; the repository's modules go
        if (getattr(module, "__file__", None) or "").startswith({ROOT + os.sep!r}):
            del sys.modules[name]
    sys.path[:] = start
    runpy.run_path(script, run_name="imported")
    print("imported", script)
"""
    scripts = [os.path.join("bench", name) for name in sorted(RUNS)]
    out = run(["-c", code, *scripts])
    assert out.split("\n")[:-1] == [f"imported {s}" for s in scripts]


def test_vllm_compare_worker_serves_ours_on_an_exported_model(tmp_path):
    """bench/vllm_compare.py's worker for this engine (what it runs beside vLLM's, each run its own process): an
    exported GPT-2-vocabulary model, beam search (the forks extension), each of every request's beams its new tokens."""
    from harness.checkpoints import export_hf
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    export_hf(GPT(GPTConfig(block_size=64, vocab_size=50257, n_layer=1, n_head=2, n_embd=32)), str(tmp_path / "hf"))
    prompts = [[464, 3290, 318], [40, 588, 257, 1110, 13], [15496]]
    job = dict(
        folder=str(tmp_path / "hf"), timed=prompts, warm=prompts[::-1], new=5, dtype="float32", beams=2, samples=1
    )
    (tmp_path / "job.json").write_text(json.dumps(job))
    out = run(["bench/vllm_compare.py", "--worker", "ours", "--worker-job", str(tmp_path / "job.json")])
    result = json.loads(out.split("RESULT ", 1)[1])
    assert [[len(beam) for beam in beams] for beams in result["outputs"]] == [[5, 5]] * len(prompts)
    assert result["peak_blocks"] > 0


def regenerate_commands():
    """docs/regenerate.sh's commands as (script, argv): its `run NAME ARGS` (generate.py), `bench NAME SCRIPT
    ARGS` and `python SCRIPT ARGS` lines, continuation lines joined, comments and redirections dropped."""
    with open(os.path.join(ROOT, "docs", "regenerate.sh")) as f:
        text = f.read().replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        if "() {" in line:  # the two helpers' own definitions
            continue
        w = words(line)
        if w[:1] == ["run"]:
            commands.append(("generate.py", w[2:]))
        elif w[:1] == ["bench"]:
            commands.append((f"bench/{w[2]}", w[3:]))
        elif w[:1] == ["python"]:
            commands.append((w[1], w[2 : w.index(">")] if ">" in w else w[2:]))
    return commands


def test_every_command_of_regenerate_sh_parses_with_todays_flags(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the output folders parse_args makes land here
    modules = {"generate.py": generate, "bench/fork_memory.py": fork_memory, "bench/floor.py": floor}
    modules.update({"bench/sampling.py": sampling, "bench/compile_cpu.py": compile_cpu})
    commands = regenerate_commands()
    assert len(commands) >= 14 and {script for script, _ in commands} == set(modules), commands
    for module in set(modules.values()):  # no prefix matching: a flag renamed to a longer one must fail here
        monkeypatch.setattr(module, "parser", lambda make=module.parser: no_abbreviations(make()))
    for script, argv in commands:
        module = modules[script]
        parse = getattr(module, "parse_args", None) or module.parser().parse_args
        try:
            parse(argv)
        except SystemExit as e:
            pytest.fail(f"docs/regenerate.sh: {script} {' '.join(argv)}: {e.code}")


def no_abbreviations(p):
    p.allow_abbrev = False
    return p
