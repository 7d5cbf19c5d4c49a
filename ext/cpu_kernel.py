"""Decode attention, the sampler's draw and logprobs' scores through C kernels of our own, on a CPU (compile="kernel").
The core's decode attention on a CPU gathers each row's blocks and calls SDPA (below 16 rows), or runs gather_attend
through torch.compile; either way a step's rows go through torch ops made for dense tensors. ext/decode_attention.c
walks each row's block table itself: one row per thread at a time, every head of a slot read at once, scores, softmax
and sums in float32 (bf16 values widened as they are read, or a bf16 pool's scores in bf16 pairs where the CPU has
AVX512-BF16; float64 pools in float64), so nothing is gathered and no graph is dispatched
(docs/vllm.md#decode-attention-in-c). The step's draw runs through ext/sample.c, every row in one call
(docs/floor_and_sampling.md#the-whole-draw-in-c---compile-kernel-2026-11-28): greedy rows' argmax; a top-k row's
candidates from ext/top_k.c (two passes over a row, no sort: 4x as fast as torch.topk at 64 x 50,304, k = 201), then
the core's cut and draw on them; a row with no top-k scaled, weighed and drawn in id order, top-p alone cutting from
a histogram of its weights instead of a sort of the row. Its tokens are the core's, but where a u falls within the
rounding of the weights' exp of a boundary (its exp and torch's differ by an ulp in ~1% of values), or among tied
top-k candidates (the lower id first, where torch's order among ties is its own). Where rows ask for logprobs, the
same call scores each row as it draws it (sample_scored, ext/logprobs.py's seam): the row read once, and a top-k
row's likeliest ids its candidates'.

The kernels are built at first use with the system's C compiler (cc, or $CC) into a cache folder, once per source,
compiler, flags and CPU (they are compiled for the CPU they run on, -march=native), and loaded with ctypes after
torch, so that their OpenMP threads are torch's (with gcc: its libgomp is the one torch loaded; clang would bring its
own runtime). Prompt chunks keep SDPA; a float16 pool keeps the core's attention; a GPU is refused. Plugs into the
paged engine at batch_class and sample, and offers sample_scored. kernel_topk is top_k.c's selection on its own,
which the tests hold to a stable sort."""

import ctypes
import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from paged import PagedBatch
from sampling import argmax

SOURCES = [Path(__file__).with_name(name) for name in ("decode_attention.c", "top_k.c", "sample.c")]  # one library
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC"]
REAL = {torch.float32: "float", torch.bfloat16: "float", torch.float64: "double"}  # what a pool's rows compute in
BUILD_FLAGS = {"float": [], "double": ["-DREAL=double", "-DEXP=exp"]}  # the kernel's two builds


def cpu_flags():
    """The CPU's feature flags, which -march=native compiles for (Linux; elsewhere the machine's name)."""
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return os.uname().machine


def cache_folder():
    """$XDG_CACHE_HOME/nanogpt-paged, or ~/.cache/nanogpt-paged where it is unset, empty or relative (as XDG says)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(base) if os.path.isabs(base) else Path.home() / ".cache") / "nanogpt-paged"


def build(compiler, flags, library):
    """Compile the kernels into `library`: aside, then renamed, so that no process loads a half-written one."""
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as folder:
        built = Path(folder) / library.name
        command = [*compiler, *flags, *map(str, SOURCES), "-o", str(built), "-lm"]
        done = subprocess.run(command, check=False, capture_output=True, text=True)
        if done.returncode:
            lines = done.stderr.strip().splitlines() or ["no message"]
            why = next((line for line in lines if "error" in line), lines[-1])  # the first error the compiler names
            names = " and ".join(source.name for source in SOURCES)
            raise RuntimeError(f"compile 'kernel': {' '.join(compiler)} could not build {names}: {why}")
        os.replace(built, library)


def library_for(real):
    """-> the compiler (a command: $CC may carry arguments), its flags, and the cached library's path: one per
    source, compiler, flags and CPU."""
    compiler = shlex.split(os.environ.get("CC") or "cc")
    if shutil.which(compiler[0]) is None:
        raise RuntimeError(
            f"compile 'kernel' builds a C kernel, but no C compiler {compiler[0]!r} is on the PATH: set CC"
        )
    flags = FLAGS + BUILD_FLAGS[real]
    sources = b"".join(source.read_bytes() for source in SOURCES)
    key = hashlib.sha256(sources + " ".join([*compiler, *flags, cpu_flags()]).encode()).hexdigest()[:16]
    return compiler, flags, cache_folder() / f"cpu_kernel_{real}_{key}.so"


@functools.cache
def load_kernel(real="float"):
    """-> the kernels' library whose decode attention computes in `real` (its top_k is float32's in either),
    built at first use into cache_folder(). A cached library that does not load (cut short, say) is built
    again, once."""
    compiler, flags, library = library_for(real)
    try:
        if not library.exists():
            build(compiler, flags, library)
        try:
            kernels = ctypes.CDLL(str(library))
        except OSError:  # cut short or corrupt
            build(compiler, flags, library)
            kernels = ctypes.CDLL(str(library))
    except OSError as e:
        raise RuntimeError(f"compile 'kernel': cannot build or load {library}: {e}") from None
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    kernels.decode_attend.argtypes = [pointer] * 6 + [size] * 6 + [ctypes.c_double, ctypes.c_int, ctypes.c_int]
    kernels.top_k.argtypes = [pointer, size, size, size, pointer, pointer, ctypes.c_int]
    scores = [size, *[pointer] * 4]  # score_rows' width and outputs
    draws = [pointer, size, size, *[pointer] * 3, ctypes.c_int, pointer]  # logits, R, V, ..., wide, tokens
    kernels.sample_rows.argtypes = [*draws, pointer, *scores, ctypes.c_int]  # scored, width, outputs, threads
    kernels.score_rows.argtypes = [pointer, size, size, pointer, *scores, ctypes.c_int]
    for kernel in (kernels.decode_attend, kernels.top_k, kernels.sample_rows, kernels.score_rows):
        kernel.restype = ctypes.c_int
    return kernels


def kernel_attend(q, k_pool, v_pool, table, kv_len):
    """gather_attend's contract: q (B, H, D), pools (num_blocks + 1, block_size, H, D) in q's dtype, table (B, W)
    int64, kv_len (B,) int64 -> (B, H, D), in q's dtype. A row whose keys run past its table or the pool is
    refused (ValueError), as gather_attend's indexing would."""
    B, H, D = q.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    tensors = (q, k_pool, v_pool, table, kv_len, out)
    if q.dtype not in REAL or k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
        raise ValueError(f"kernel_attend takes q and pools of one dtype, float32, bf16 or float64: not {q.dtype}")
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("kernel_attend takes contiguous pools and tables")
    if table.dtype != torch.int64 or kv_len.dtype != torch.int64:
        raise ValueError("kernel_attend takes int64 tables and key counts")
    kernel = load_kernel(REAL[q.dtype]).decode_attend
    bf16 = int(q.dtype == torch.bfloat16)
    sizes = (B, table.shape[1], H, D, k_pool.shape[1], k_pool.shape[0])
    done = kernel(*(t.data_ptr() for t in tensors), *sizes, D**-0.5, bf16, torch.get_num_threads())
    if done == -2:
        raise ValueError(f"kernel_attend: a row's keys run past its table ({table.shape[1]} blocks) or the pool")
    if done:
        raise MemoryError(f"decode attention's scratch: {B} rows of {table.shape[1]} blocks")
    return out


def kernel_topk(x, k, real="float"):
    """top_k.c's selection alone, which sample.c's top-k rows and score_rows call and the tests hold to a stable
    sort here, in torch.topk's contract: x (R, V) float32 on a CPU, 0 < k <= V -> each row's k largest values
    (R, k), best first, and their ids (R, k) int64 (of equal values the lower id first: torch's order among
    ties is its own). Anything else goes to torch.topk. real: the library to take it from (either build holds
    it)."""
    R, V = x.shape
    if x.dtype != torch.float32 or x.device.type != "cpu" or not 0 < k <= V:
        return torch.topk(x, k)
    x = x.contiguous()
    values, ids = torch.empty(R, k, dtype=torch.float32), torch.empty(R, k, dtype=torch.int64)
    top_k = load_kernel(real).top_k
    if top_k(x.data_ptr(), R, V, k, values.data_ptr(), ids.data_ptr(), torch.get_num_threads()):
        raise MemoryError(f"top_k's buffers: {2 * k + 1024} candidates a thread")
    return values, ids


def kernel_sample(logits, settings, position, real="float"):
    """sampling.sample's contract, less its hints: logits (R, V) on a CPU; settings (R, 5); position (R,) -> (R,)
    token ids, every row drawn by ext/sample.c in one call: the core's tokens, but where a draw's u falls within
    the rounding of its exp of a boundary, or among tied candidates (there, the lower id first). real: the library
    to take it from (either build holds it), the one the engine loaded for its pool."""
    tokens = draw(logits, settings, position, real)
    if logits.dtype != torch.float32:  # greedy rows take the argmax of the logits as they are, as the core's do
        tokens = tokens.where(settings[:, 0].float() > 0, argmax(logits))  # greedy in float32, as the core reads it
    return tokens


def kernel_sample_scored(logits, settings, position, scored, width, real="float"):
    """kernel_sample, and kernel_scores(logits, tokens, width) at the rows where scored (R,) bool is True, each row
    scored as it is drawn, while it is in the cache (a top-k row's likeliest ids are its candidates'): float32
    logits (R, V) on a CPU -> tokens (R,), and the scores on the host (those of the other rows unset)."""
    R, V = logits.shape
    if logits.dtype != torch.float32 or logits.device.type != "cpu" or not 0 <= width <= V:
        raise ValueError(f"kernel_sample_scored takes float32 logits on a CPU and a width in 0..{V}")
    out = score_arrays(R, width)
    tokens = draw(logits, settings, position, real, scored.to(torch.uint8).contiguous(), width, out)
    return tokens, [t.numpy() for t in out]


def draw(logits, settings, position, real, scored=None, width=0, out=None):
    """sample_rows: each row's token (R,), and where scored (R,) uint8 is given, the scores of the rows it marks
    into out (score_arrays)."""
    R, V = logits.shape
    settings, position = settings.double().contiguous(), position.long().contiguous()
    least = settings[:, 3].float().log()  # min-p's least scaled value: torch's log, as the core's cut compares it
    tokens = torch.empty(R, dtype=torch.int64)
    wide = int(torch.get_default_dtype() == torch.float64)  # the core's u, and its draw's target, in that dtype
    x = logits.float().contiguous()
    pointers = [t.data_ptr() for t in (settings, least, position)]
    marked = None if scored is None else scored.data_ptr()
    outputs = [t.data_ptr() for t in out] if out else [None] * 4
    sample_rows = load_kernel(real).sample_rows
    if sample_rows(
        x.data_ptr(), R, V, *pointers, wide, tokens.data_ptr(), marked, width, *outputs, torch.get_num_threads()
    ):
        raise MemoryError(f"sample_rows' scratch: rows of {V} ids")
    return tokens


def score_arrays(R, width):
    """score_rows' outputs: logprob (R,), rank (R,), top ids (R, width), top logprobs (R, width)"""
    logprob, rank = torch.empty(R, dtype=torch.float32), torch.empty(R, dtype=torch.int32)
    return logprob, rank, torch.empty(R, width, dtype=torch.int64), torch.empty(R, width, dtype=torch.float32)


def kernel_scores(logits, targets, width):
    """ext/logprobs.py's scores() for float32 logits on a CPU, through ext/sample.c's score_rows: logits (R, V),
    targets (R,) -> on the host: each target's logprob (R,) and rank (R,), and the width likeliest ids (R, width)
    and their logprobs (R, width); of tied values the lower id first."""
    R, V = logits.shape
    if logits.dtype != torch.float32 or logits.device.type != "cpu":
        raise ValueError(f"kernel_scores takes float32 logits on a CPU, not {logits.dtype} on {logits.device}")
    if not 0 <= width <= V:  # the engine's logprobs are at most its vocabulary's (ext/logprobs.py)
        raise ValueError(f"kernel_scores: width {width} must be in 0..{V}, the row's ids")
    if len(targets) and not 0 <= int(targets.min()) <= int(targets.max()) < V:
        raise ValueError(f"kernel_scores: targets must be ids in 0..{V - 1}")
    logits, targets = logits.contiguous(), targets.long().contiguous()
    out = score_arrays(R, width)
    pointers = [t.data_ptr() for t in out]
    score_rows = load_kernel("float").score_rows
    if score_rows(logits.data_ptr(), R, V, targets.data_ptr(), width, *pointers, torch.get_num_threads()):
        raise MemoryError(f"score_rows' scratch: rows of {V} ids")
    return [t.numpy() for t in out]


class KernelBatch(PagedBatch):
    """Every one-token entry attends through the kernel, whatever the step's size."""

    def __init__(self, *args):
        super().__init__(*args)
        self.one_token_table = self.one_token_table.contiguous()  # a cut of the host's table: once a step

    def attend_one_token(self, layer, q):
        if q.dtype not in REAL:
            return super().attend_one_token(layer, q)
        return kernel_attend(q, self.k_pool[layer], self.v_pool[layer], self.one_token_table, self.one_token_len)


class CpuKernel:
    """A PagedEngine mixin: compile="kernel" runs decode attention on a CPU through ext/decode_attention.c, and
    each step's draw through ext/sample.c (logprobs' scores too: ext/logprobs.py's scores)."""

    compile_modes = ("auto", "on", "off", "kernel")

    def __init__(self, model, **kw):
        super().__init__(model, **kw)
        if self.compile == "kernel" and self.device.type != "cpu":
            raise ValueError("compile 'kernel' is a CPU kernel; on CUDA, ask for 'graph'")
        self.real = REAL.get(self.kv_pool.dtype, "float")  # the library's build: the pool's
        if self.compile == "kernel":
            try:  # built now, so that a missing compiler is said before any request runs, as a bad setting is
                load_kernel(self.real)
            except RuntimeError as e:
                raise ValueError(str(e)) from None
            self.batch_class = KernelBatch

    def sample(self, logits, batch, samplers):
        """The core's draw (PagedEngine.sample), through ext/sample.c."""
        if self.compile != "kernel" or not any(s.request.params.temperature for s, *_ in samplers):
            return super().sample(logits, batch, samplers)  # every row greedy: the core's argmax, with no call
        return kernel_sample(logits, self.settings[batch.sample_rows], batch.sample_pos, self.real)

    def sample_scored(self, logits, batch, scored, width):
        """The draw, and logprobs' scores of the drawn tokens at the rows where scored (R,) bool is True, in one call
        (ext/logprobs.py's seam, for float32 logits under compile="kernel"): -> tokens (R,), and the scores."""
        settings = self.settings[batch.sample_rows]
        return kernel_sample_scored(logits, settings, batch.sample_pos, scored, width, self.real)
