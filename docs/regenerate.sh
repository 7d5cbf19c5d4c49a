#!/usr/bin/env bash
# Regenerate the figures and tables in docs/ that the README shows (about 12 minutes on 2 CPU cores for
# generate.py's, and about 50 more for the benchmarks: each long one says its own time below). Not here: the
# benchmarks that need another virtualenv (vllm_compare.py, hf_compare.py, bf16_quality.py beside vLLM) or whose files
# name the CPU they ran on (gemm_bound.py, decode_attention.py); bench/README.md gives their commands. The archived
# benchmarks (bench/archive/) are not rerun: their outputs in docs/archive/ record designs that were not kept.
# The README's own example commands write to out/ instead, so trying them never touches tracked files.
set -euo pipefail
cd "$(dirname "$0")/.."
run() { name=$1; shift; echo "python generate.py $*" > "docs/$name.txt"; python generate.py "$@" >> "docs/$name.txt"; }
run compare_mixed --compare --num-requests 128 --prompt-len 8:192 --new-tokens 8:64 --seed 1 \
    --plot docs/compare_mixed.png --json docs/compare_mixed.json
run compare_prefix --compare --num-requests 64 --shared-prefix 200 --prompt-len 201:224 --new-tokens 16:32 --seed 1 \
    --plot docs/compare_prefix.png --json docs/compare_prefix.json
run kv_budget --compare --kv-budget 4096 --num-requests 256 --prompt-len 8:128 --new-tokens 8:128 --seed 1 \
    --plot docs/kv_budget.png --json docs/kv_budget.json
run rate_sweep --compare --kv-budget 4096 --num-requests 150 --prompt-len 8:128 --new-tokens 8:128 --seed 1 \
    --sweep-rates 10,15,20,30,40,60 --plot docs/rate_sweep.png --json docs/rate_sweep.json
# the vLLM paper's Sec. 7.2 and 7.3 (about a minute each; one thread keeps them steady on a shared machine)
run block_size --sweep-block-sizes 1,2,4,8,16,32,64,128,256 --num-requests 128 --request-rate 256 --kv-budget 2048 \
    --threads 1 --seed 1 --plot docs/block_size.png --json docs/block_size.json
run swap --sweep-preemption 1,2,4,8,16,32,64,128,256 --num-requests 64 --request-rate 256 --kv-budget 1024 \
    --threads 1 --seed 1 --plot docs/swap.png --json docs/swap.json
python bench/floor.py > docs/floor.txt
python bench/floor.py --vocab-size 50304 > docs/floor_50k.txt
python bench/fork_memory.py --plot docs/fork_memory.png > docs/fork_memory.txt
python bench/fork_memory.py --prompt-len 8:32 --new-tokens 32:96 > docs/fork_memory_short_prompts.txt
python bench/compile_cpu.py > docs/compiled_vs_eager_decode.txt    # about 40 minutes on 2 cores: 12-layer, 768-wide models
bench() { name=$1; shift; echo "python bench/$*" > "docs/$name.txt"; python "bench/$@" >> "docs/$name.txt"; }
bench sampled_vs_greedy sampling.py         # about 8 minutes
# the block pool over three runs (each a few seconds)
python generate.py --paged --num-requests 64 --shared-prefix 200 --prompt-len 201:224 --new-tokens 16:32 --seed 1 \
    --num-blocks 256 --pool-map docs/pool_prefix.png
python generate.py --paged --num-requests 16 --num-beams 4 --prompt-len 16:64 --new-tokens 64:64 --seed 1 \
    --pool-map docs/pool_beams.png
python generate.py --paged --num-requests 64 --prompt-len 8:128 --new-tokens 8:128 --seed 1 --num-blocks 96 \
    --pool-map docs/pool_pressure.png
