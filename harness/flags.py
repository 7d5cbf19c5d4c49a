"""The command line's argument types and the checks parse_args makes of its flags together: each failure is one
line on stderr and a non-zero exit, never a traceback."""

import argparse
import math
import os
import sys


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the docstring's lines and shows every flag's default, unless its help already says it."""

    def _get_help_string(self, action):
        return action.help if "(default:" in action.help else super()._get_help_string(action)


def fail(message):
    sys.exit(f"error: {message}")


def number_type(least=None, above=None, kind=int, allow_inf=False):
    """An argparse type: a finite number (or inf where allowed) at least `least` or above `above`."""

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (math.isfinite(value) or (allow_inf and value == math.inf)):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number")
        if (least is not None and not value >= least) or (above is not None and not value > above):
            raise argparse.ArgumentTypeError(
                f"{text} is below {least}" if least is not None else f"{text} must be above {above}"
            )
        return value

    return parse


def span(text):
    lo, _, hi = text.partition(":")
    try:
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        lo = hi = 0
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r} is not MIN:MAX with 1 <= MIN <= MAX")
    return lo, hi


def rates(text):
    return [number_type(above=0, kind=float)(r) for r in text.split(",")]  # finite: a sweep plots each rate


MAX_ARRIVAL_S = 3600  # a run's requests arrive within an hour: a slower rate would leave the run silent for hours


def check_arrivals(num_requests, rates):
    """Poisson arrivals at the slowest rate spread num_requests over ~num_requests / rate seconds: at most an hour."""
    slowest = min(rates)
    if num_requests / slowest > MAX_ARRIVAL_S:
        least = num_requests / MAX_ARRIVAL_S
        fail(
            f"request rate {slowest:g}/s: {num_requests} requests would take ~{num_requests / slowest:.3g} s to arrive; "
            f"a run's arrivals last at most an hour, a rate of at least {least:.3g}/s"
        )


def block_sizes(text):
    return [number_type(1)(b) for b in text.split(",")]


def check_sweep(args, sweep):
    """A sweep over block sizes draws its own workloads and runs the paged engine eager, or fails in one line."""
    flags = ["--sweep-block-sizes", "--sweep-preemption", "--compare", "--prompt-len", "--new-tokens", "--swap-blocks"]
    given = [flag for flag in flags if getattr(args, flag[2:].replace("-", "_"))]
    if len(given) > 1:
        fail(f"{given[0]} draws its own workloads and engines: it takes no {', '.join(given[1:])}")
    if args.pool_map or args.prompt or args.prompts:
        fail(f"{given[0]} serves its own workloads: it takes no --pool-map, --prompt or --prompts")
    # on, graph: dynamo would compile a graph per block size, past its limit of 8; step: ~35-60 s for a sweep's
    # few small steps; kernel: eager is what the sweep's figures are measured with
    if args.compile in ("on", "graph", "step", "kernel"):
        fail(f"{given[0]} runs decode attention eager: it takes no --compile {args.compile}")
    args.compile = "off"
    if args.kv_budget and args.kv_budget < max(sweep):
        fail(f"--kv-budget {args.kv_budget} slots hold no block of {max(sweep)}")


def check_image_name(flag, path):
    from matplotlib.backend_bases import FigureCanvasBase

    kinds = FigureCanvasBase.get_supported_filetypes()
    if os.path.splitext(path)[1][1:].lower() not in kinds:
        fail(f"{flag} {path}: the file name must end in one of .{', .'.join(sorted(kinds))}")


def prepare_output(flag, path):
    """Make the folder that `path` will be written to, if missing, or fail in one line: now, not after the run."""
    if path.endswith(os.sep) or os.path.isdir(path):
        fail(f"{flag} {path}: a folder; name the file to write")
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        fail(f"{flag} {path}: cannot make the folder {folder}: {e.strerror}")
    if not os.access(folder, os.W_OK):
        fail(f"{flag} {path}: the folder {folder} is not writable")


def speculative_tokens(text):
    """--num-speculative-tokens: auto, or a whole number >= 0."""
    if text == "auto":
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a number >= 0 or auto")
    return int(text)
