#!/usr/bin/env bash
# Regenerate the figures and tables in docs/ that the README shows (about 12 minutes on 2 CPU cores for
# generate.py's, and about 100 more for the benchmarks: each says its own time below). bench/vllm_compare.py and
# bench/hf_compare.py are not here: they need their own virtualenvs (see the README).
# The README's own example commands write to out/ instead, so trying them never touches tracked files.
set -euo pipefail
cd "$(dirname "$0")/.."
run() { name=$1; shift; echo "python generate.py $*" > "docs/$name.txt"; python generate.py "$@" >> "docs/$name.txt"; }
run compare_mixed --compare --num-requests 128 --prompt-len 8:192 --new-tokens 8:64 --seed 1 \
    --plot docs/compare_mixed.png --json docs/compare_mixed.json
run compare_prefix --compare --num-requests 64 --shared-prefix 200 --prompt-len 201:224 --new-tokens 16:32 --seed 1 \
    --plot docs/compare_prefix.png --json docs/compare_prefix.json
run budget --compare --kv-budget 4096 --num-requests 256 --prompt-len 8:128 --new-tokens 8:128 --seed 1 \
    --plot docs/budget.png --json docs/budget.json
run sweep --compare --kv-budget 4096 --num-requests 150 --prompt-len 8:128 --new-tokens 8:128 --seed 1 \
    --sweep-rates 10,15,20,30,40,60 --plot docs/sweep.png --json docs/sweep.json
# the vLLM paper's Sec. 7.2 and 7.3 (about a minute each; one thread keeps them steady on a shared machine)
run block_size --sweep-block-sizes 1,2,4,8,16,32,64,128,256 --num-requests 128 --request-rate 256 --kv-budget 2048 \
    --threads 1 --seed 1 --plot docs/block_size.png --json docs/block_size.json
run swap --sweep-preemption 1,2,4,8,16,32,64,128,256 --num-requests 64 --request-rate 256 --kv-budget 1024 \
    --threads 1 --seed 1 --plot docs/swap.png --json docs/swap.json
python bench/floor.py > docs/floor.txt
python bench/floor.py --vocab-size 50304 > docs/floor_50k.txt
python bench/fork_memory.py --plot docs/fork_memory.png > docs/fork_memory.txt
python bench/fork_memory.py --prompt-len 8:32 --new-tokens 32:96 > docs/fork_memory_short_prompts.txt
python bench/compile_cpu.py > docs/compile_cpu.txt    # about 40 minutes on 2 cores: 12-layer, 768-wide models
bench() { name=$1; shift; echo "python bench/$*" > "docs/$name.txt"; python "bench/$@" >> "docs/$name.txt"; }
bench sampling sampling.py                  # about 8 minutes
bench prefill_attention prefill_attention.py
bench compile_step compile_step.py --workloads tiny/mixed,tiny/decode,tiny/prefill,gpt2/mixed,gpt2/decode,gpt2/prefill  # about 20 minutes
graph_workloads=tiny/decode,tiny/mixed,gpt2/decode,gpt2/mixed  # about 12 minutes each; each prints its own command
(python bench/compile_graph.py --workloads $graph_workloads --gelu-postop off; echo;
    python bench/compile_graph.py --workloads $graph_workloads --gelu-postop on) > docs/compile_graph.txt
python bench/compile_graph.py --workloads tiny/decode,gpt2/decode --gelu-postop off --profile > docs/compile_graph_profile.txt
(for run in 1 2 3; do python bench/linear_postops.py; echo; done) > docs/linear_postops.txt
# the block pool over three runs (each a few seconds)
python generate.py --paged --num-requests 64 --shared-prefix 200 --prompt-len 201:224 --new-tokens 16:32 --seed 1 \
    --num-blocks 256 --pool-map docs/pool_prefix.png
python generate.py --paged --num-requests 16 --num-beams 4 --prompt-len 16:64 --new-tokens 64:64 --seed 1 \
    --pool-map docs/pool_beams.png
python generate.py --paged --num-requests 64 --prompt-len 8:128 --new-tokens 8:128 --seed 1 --num-blocks 96 \
    --pool-map docs/pool_pressure.png
