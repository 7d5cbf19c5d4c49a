"""What generate.py runs: the prompts or a seeded workload served by each design its flags name, the sweeps over
block sizes and preemption modes, and what is printed and written of them."""

import json
import math
from types import SimpleNamespace

import torch

from harness.checkpoints import export_hf, get_tokenizer, load_checkpoint
from harness.flags import check_arrivals, fail
from harness.metrics import LABELS, agreement, outputs, returned, speculation, sweep_table, table
from harness.plots import PoolMap, plot, plot_block_sizes, plot_preemption
from harness.serving import (
    LENGTH_MIXES,
    MICRO_SEQUENCES,
    MICRO_TOKENS,
    make_engine,
    make_requests,
    serve,
    sweep_block_sizes,
    sweep_preemption,
    warm_up,
    workload,
)
from harness.tuning import prepare
from sequence import Request, RequestStatus


def read_prompts(args, enc):
    """The prompts as (texts, token lists, new-token counts), or exit with a one-line error."""
    if args.num_requests:
        try:
            prompts, news = workload(enc, args)
        except ValueError as e:
            fail(e)
        return [enc.decode(p) for p in prompts], prompts, news
    texts = list(args.prompt or [])
    if args.prompts:
        try:
            with open(args.prompts, encoding="utf-8") as f:
                texts += [line.rstrip("\n").replace("\\n", "\n") for line in f if line.strip()]
        except OSError as e:
            fail(f"cannot read --prompts file {args.prompts}: {e.strerror}")
        except UnicodeDecodeError as e:
            fail(f"--prompts file {args.prompts} is not UTF-8 text: {e.reason} at byte {e.start}")
        if not texts:
            fail(f"--prompts file {args.prompts} holds no prompt")
    texts = texts or ["ROMEO:\n", "JULIET:\n", "HAMLET:\n", "KING LEAR:\n"]
    prompts = [enc.encode(t, allowed_special={"<|endoftext|>"}) for t in texts]  # Engine.add checks each
    return texts, prompts, [args.max_new_tokens] * len(prompts)


def write_json(path, out):
    """Standard JSON, which has no infinity: a non-finite number (the default request rate, inf) is written as the
    string Python prints for it, "inf", "-inf" or "nan"."""

    def finite(x):
        if isinstance(x, float) and not math.isfinite(x):
            return str(x)
        if isinstance(x, dict):
            return {k: finite(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [finite(v) for v in x]
        return x

    with open(path, "w") as f:
        json.dump(finite(out), f, indent=1, allow_nan=False)


def request_json(texts, requests, enc, speculation=None):
    """The finished requests, with their samples or beams, and what speculative decoding did for each."""
    done = []
    for i, r in enumerate(requests):
        if r.status is not RequestStatus.DONE:
            continue
        done.append(
            {
                "index": i,
                "prompt": texts[i],
                "prompt_tokens": r.prompt,
                "output_tokens": r.generated,
                "text": enc.decode(r.generated),
            }
        )
        if (
            r.params.n > 1 or r.params.num_beams > 1
        ):  # samples in order; beams best first, with HF's length-penalized score
            done[-1]["sequences"] = [
                dict(
                    output_tokens=s.generated,
                    text=enc.decode(s.generated),
                    seed=s.seed,
                    **(dict(score=s.score) if r.params.num_beams > 1 else {}),
                    **(dict(logprobs=sequence_logprobs(s, enc)) if r.params.logprobs is not None else {}),
                )
                for s in r.sequences
            ]
        if r in (speculation or {}):
            done[-1]["speculation"] = spec_figures(*speculation[r])
        if r.params.logprobs is not None:  # the first sample's, as its output_tokens; each sample's in sequences
            done[-1]["logprobs"] = sequence_logprobs(r.sequences[0], enc)
    return done


def sequence_logprobs(s, enc):
    return [logprobs_json(entry, enc, s.request.params.logprobs) for entry in s.logprobs]


def logprobs_json(entry, enc, n):
    """A token's logprobs entry (ext/logprobs.py: its own id first, then the likeliest ids') -> the token, its
    log-probability and rank, and the n likeliest tokens', itself among them if it is one."""
    (token, own), *_ = entry.items()
    top = sorted(entry.items(), key=lambda item: item[1].rank)[:n]
    pick = dict(id=token, text=enc.decode([token]), logprob=own.logprob, rank=own.rank)
    return dict(pick, top=[dict(id=i, text=enc.decode([i]), logprob=x.logprob, rank=x.rank) for i, x in top])


def logprobs_lines(s, enc):
    """Each new token of s, its log-probability and rank, and the likeliest tokens', one line each."""
    lines = []
    for entry in s.logprobs:
        t = logprobs_json(entry, enc, s.request.params.logprobs)
        top = ", ".join(f"{x['text']!r} {x['logprob']:.3f}" for x in t["top"])
        lines.append(f"  {t['text']!r:>14} {t['logprob']:8.3f} (rank {t['rank']})" + (f" | {top}" if top else ""))
    return "\n".join(lines)


def spec_line(figures):
    share = "-" if figures["acceptance_pct"] is None else f"{figures['acceptance_pct']:.0f}%"
    per_step = "-" if figures["tokens_per_verify"] is None else f"{figures['tokens_per_verify']:.2f}"
    return f"{figures['accepted_tokens']} of {figures['proposed_tokens']} proposed tokens accepted ({share}), {per_step} tokens per verify step"


def spec_figures(proposed, accepted, verify_steps):
    """proposed, accepted (and its share), tokens per verify step, with metrics.speculation's names."""
    return {k.removeprefix("spec_"): v for k, v in speculation(proposed, accepted, verify_steps).items()}


def load_model(args):
    """The checkpoint in --dtype, prepared (its linears prepacked for oneDNN on a CPU), and its tokenizer."""
    try:
        model = load_checkpoint(args.ckpt, args.device).to(getattr(torch, args.dtype))
        enc = get_tokenizer(model.config.vocab_size)
    except ValueError as e:
        fail(e)
    prepare(model)  # process settings, and CPU linears packed for oneDNN (harness/tuning.py)
    return model, enc


def choose_designs(args):
    """The engines to run: every design with --compare; else the one that --paged and --kv-budget name."""
    if args.compare:
        kinds = ["contiguous_max", "contiguous_pow2", "contiguous_oracle"] if args.kv_budget else ["contiguous"]
        return kinds + ["paged", "paged_prefix"]
    if args.paged:
        return ["paged" if args.no_prefix_cache else "paged_prefix"]
    return ["contiguous_" + (args.reserve or "max") if args.kv_budget else "contiguous"]


def run_designs(model, kinds, args, prompts, news, vocab_size, results):
    """Warm every design up untimed, then serve the workload with each, at each rate. results fills in as
    runs finish, so that an interrupt keeps them."""
    for kind in kinds:  # untimed: first calls pay one-time setup, which would bias the first design run
        engine = make_engine(model, kind, args, prompts, news, vocab_size)
        for r in make_requests(args, prompts, news):  # refuse what can never run before compiling anything
            engine.check(r)
        warm_up(engine, len(prompts) * max(args.num_samples, args.num_beams))
        make_engine(model, kind, args, prompts, news, vocab_size).run([Request(p[:16], 2) for p in prompts[:2]])
    for rate in args.sweep_rates or [args.request_rate]:
        results.runs, results.rate = {}, rate
        for kind in kinds:
            engine = make_engine(model, kind, args, prompts, news, vocab_size)
            results.requests = make_requests(args, prompts, news)
            results.pool_map = PoolMap(engine) if args.pool_map else None  # --paged: one design
            results.runs[kind], meter = serve(engine, results.requests, args, rate)
            results.steps[kind] = meter.steps
            results.speculation = meter.speculation  # per request (ext/speculative.py)
            if kind == kinds[0]:
                first = results.requests
            else:  # token for token against the first run, on the same workload
                pairs = list(zip(results.requests, first))
                same = sum(outputs(r) == outputs(f) for r, f in pairs)
                results.runs[kind]["same_output_pct"] = 100 * same / len(first)
                shares = [agreement(a, b) for r, f in pairs for a, b in zip(outputs(f), outputs(r))]
                results.runs[kind]["same_prefix_pct"] = 100 * sum(shares) / len(shares)
        results.sweep.append({"request_rate": rate, "runs": results.runs})
        if args.sweep_rates:
            print(f"--- request rate {rate:g}/s\n{table(results.runs)}", flush=True)


def report(args, kinds, texts, prompts, results, enc):
    """Print the samples or the table, and write the JSON and the plot."""
    runs, requests = results.runs, results.requests
    workload_name = (
        f"{len(prompts)} requests, prompts {args.prompt_len[0]}-{args.prompt_len[1]} tokens, "
        f"{args.new_tokens[0]}-{args.new_tokens[1]} new"
        if args.num_requests
        else f"{len(prompts)} prompts"
    )
    if args.kv_budget:
        workload_name += f", KV budget {args.kv_budget:,} slots"
    if not args.num_requests and not args.compare:
        for i, r in enumerate(requests):
            for j, s in enumerate(returned(r)):
                which = f", sample {j} (seed {s.seed})" if r.params.n > 1 else ""
                which += (
                    f", best of {r.params.num_beams} beams (score {r.sequences[0].score:.4f})"
                    if r.params.num_beams > 1
                    else ""
                )
                if r in results.speculation and j == 0:  # the request's, over all its samples
                    which += ", " + spec_line(spec_figures(*results.speculation[r]))
                print(f"--- request {i}{which}, {len(s.generated)} new tokens\n{texts[i]}{enc.decode(s.generated)}")
                if r.params.logprobs is not None:
                    print(f"--- its tokens' logprobs (raw), each with its rank, then the {r.params.logprobs} likeliest")
                    print(logprobs_lines(s, enc))
        m = runs[kinds[0]]
        print(
            f"--- {LABELS[kinds[0]]}: {m['output_tokens']:,} new tokens in {m['wall_s']:.2f} s, "
            f"{m['output_tok_s']:,.0f} tok/s ({args.device}, {args.dtype})"
        )
        if "spec_proposed_tokens" in m:
            print(f"--- speculation in all: {spec_line({k.removeprefix('spec_'): v for k, v in m.items()})}")
    if (args.num_requests or args.compare or args.metrics) and not args.sweep_rates:  # a sweep printed its tables
        print(f"--- {workload_name} on {args.device}, {args.dtype}\n{table(runs)}")
        if args.compare and args.dtype == "bfloat16":
            print(
                "in bfloat16 the designs round differently (their attention kernels and batch shapes differ), so "
                "outputs part after some tokens: same_output_pct checks the engine only in float32 and "
                "float64; same_prefix_pct is how much of each output agrees before it parts "
                "(docs/bf16.md#comparisons-in-bf16)"
            )
    for point in results.sweep:  # never silently: swap that fell back to recomputing says so, in one line
        for kind, m in point["runs"].items():
            if m.get("swap_fallbacks"):
                at = f" at {point['request_rate']:g} requests/s" if args.sweep_rates else ""
                print(
                    f"{LABELS[kind]}{at}: {m['swap_fallbacks']} preempted sequences were recomputed instead of swapped: "
                    f"the swap space of {m['swap_blocks']} blocks could not take them"
                )
    if args.json:
        if args.sweep_rates:
            out = {"sweep": results.sweep}
        elif args.compare:
            out = {"runs": runs}
        else:
            out = {"metrics": runs[kinds[0]], "requests": request_json(texts, requests, enc, results.speculation)}
        write_json(args.json, out)
    if args.plot:
        plot(results.steps, results.sweep if args.sweep_rates else None, args.plot, workload_name)
        print(f"plot written to {args.plot}")
    if args.pool_map:
        pool_map = results.pool_map
        num_blocks, steps = pool_map.engine.allocator.num_blocks, len(pool_map.states)
        pool_map.draw(args.pool_map, f"{workload_name}, {LABELS[kinds[0]]}: {num_blocks} blocks of {args.block_size}")
        print(f"pool map written to {args.pool_map}: {num_blocks} blocks over {steps} steps")


def run_sweep(model, enc, args):
    """--sweep-block-sizes or --sweep-preemption: the runs, their tables, JSON and plot."""
    kind = "paged" if args.no_prefix_cache else "paged_prefix"
    used = LENGTH_MIXES if args.sweep_block_sizes else ["ShareGPT"]
    mixes = ", ".join(f"{mix} prompts {LENGTH_MIXES[mix][0]}, new {LENGTH_MIXES[mix][1]}" for mix in used)
    budget = f"KV budget {args.kv_budget:,} slots" if args.kv_budget else "a pool that holds every request"
    check_arrivals(args.num_requests, [args.request_rate])
    setup = f"{args.num_requests} requests a run at {args.request_rate:g}/s, {budget}"
    where = f"{args.device}, {args.dtype}, {torch.get_num_threads()} threads"
    print(f"{setup}, seed {args.seed}; {mixes} tokens (MIN, MAX); {LABELS[kind]}, eager attention, {where}")
    if args.sweep_block_sizes:
        out = {"block_sizes": sweep_block_sizes(model, enc, args, kind)}
        print_block_sizes(out["block_sizes"])
        title = f"block size: ShareGPT's and Alpaca's mean lengths / 4; {setup}; {where}"
    else:
        out = {"preemption": sweep_preemption(model, enc, args, kind)}
        print_preemption(out["preemption"])
        title = f"recompute against swap: ShareGPT's mean lengths / 4; {setup}; {where}"
    if args.json:
        write_json(args.json, out)
    if args.plot:
        (plot_block_sizes if args.sweep_block_sizes else plot_preemption)(next(iter(out.values())), args.plot, title)
        print(f"plot written to {args.plot}")


def print_block_sizes(results):
    columns = [("ms/token", "normalized_latency_ms"), ("output tok/s", "output_tok_s"), ("running", "running_mean")]
    columns += [("preemptions", "preemptions"), ("KV MB peak", "kv_allocated_peak_mb")]
    columns += [("tokens' MB", "kv_used_peak_mb")]
    for mix, runs in results.items():
        print(f"--- {mix}\n{sweep_table([(f'block size {b}', m) for b, m in runs.items()], columns)}")


def print_preemption(points):
    columns = [("swap out ms", "swap_out_ms"), ("swap in ms", "swap_in_ms"), ("recompute ms", "recompute_ms")]
    rows = [(f"block size {p['block_size']}", p) for p in points]
    print(f"--- {MICRO_SEQUENCES} sequences of {MICRO_TOKENS} tokens preempted and readmitted, medians of 3")
    print(sweep_table(rows, columns))
    rows = [(f"{mode}, block size {p['block_size']}", p[mode]) for p in points for mode in ("recompute", "swap")]
    columns = [
        ("ms/token", "normalized_latency_ms"),
        ("preemptions", "preemptions"),
        ("swapped out", "swapped_out_blocks"),
    ]
    columns += [("swap MB", "swap_mb"), ("swap out ms", "swap_out_ms"), ("swap in ms", "swap_in_ms")]
    columns += [("recomputed", "recomputed_tokens"), ("recompute ms", "recompute_ms")]
    print(f"--- ShareGPT mix under the KV budget, each preemption mode\n{sweep_table(rows, columns)}")


def serve_prompts(model, enc, args):
    """Serve --prompt, --prompts or a --num-requests workload with the designs the flags name, then report; an
    interrupt keeps what finished."""
    texts, prompts, news = read_prompts(args, enc)
    check_arrivals(len(prompts), args.sweep_rates or [args.request_rate])
    kinds = choose_designs(args)
    if args.kv_budget:
        c = model.config  # one slot: one token's K and V in every layer and head
        slot_bytes = 2 * c.n_layer * c.n_embd * model.lm_head.weight.element_size()
        print(
            f"KV budget: {args.kv_budget:,} slots x {slot_bytes:,} bytes = {args.kv_budget * slot_bytes / 2**20:,.1f} MB"
        )
    results = SimpleNamespace(sweep=[], runs={}, rate=None, steps={}, requests=[], speculation={})
    try:
        run_designs(model, kinds, args, prompts, news, enc.n_vocab, results)
    except ValueError as e:
        fail(e)
    except KeyboardInterrupt:  # keep what finished: the runs done, and the requests done in this one
        done = request_json(texts, results.requests, enc)
        if args.json:
            # a sweep: its finished points, then the rate whose runs were cut short
            sweep = {"sweep": results.sweep, "request_rate": results.rate} if args.sweep_rates else {}
            out = {"interrupted": True, **sweep, "runs": results.runs, "requests": done}
            write_json(args.json, out)
        fail(
            f"interrupted: {len(done)} of {len(results.requests)} requests of this run had finished"
            + (f"; they and the finished runs are in {args.json}" if args.json else "")
        )
    report(args, kinds, texts, prompts, results, enc)


def export(args):
    """--export-hf: no training on the way; exporting a checkpoint that is not there is an error."""
    try:
        export_hf(load_checkpoint(args.ckpt), args.export_hf)
    except ValueError as e:
        fail(e)
    print(
        f"exported {args.ckpt} to {args.export_hf}: config.json, model.safetensors, vocab.json, merges.txt, "
        "tokenizer_config.json"
    )
