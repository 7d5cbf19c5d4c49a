"""Decode attention through a C kernel of our own, on a CPU (compile="kernel"). The core's decode attention on a
CPU gathers each row's blocks and calls SDPA (below 16 rows), or runs gather_attend through torch.compile; either
way a step's rows go through torch ops made for dense tensors. ext/decode_attention.c walks each row's block
table itself: one row per thread at a time, every head of a slot read at once, scores, softmax and sums in
float32 (bf16 values widened as they are read, or a bf16 pool's scores in bf16 pairs where the CPU has
AVX512-BF16; float64 pools in float64), so nothing is gathered and no graph is dispatched
(docs/vllm.md#decode-attention-in-c).

The kernel is built at first use with the system's C compiler (cc, or $CC) into a cache folder, once per source,
compiler, flags and CPU (it is compiled for the CPU it runs on, -march=native), and loaded with ctypes after
torch, so that its OpenMP threads are torch's (with gcc: its libgomp is the one torch loaded; clang would bring
its own runtime). Prompt chunks keep SDPA; a float16 pool keeps the core's paths; a GPU is refused.
Plugs into the paged engine at batch_class."""

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

SOURCE = Path(__file__).with_name("decode_attention.c")
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC"]
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
    """Compile the kernel into `library`: aside, then renamed, so that no process loads a half-written one."""
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as folder:
        built = Path(folder) / library.name
        done = subprocess.run(
            [*compiler, *flags, str(SOURCE), "-o", str(built), "-lm"], check=False, capture_output=True, text=True
        )
        if done.returncode:
            lines = done.stderr.strip().splitlines() or ["no message"]
            why = next((line for line in lines if "error" in line), lines[-1])  # the first error the compiler names
            raise RuntimeError(f"compile 'kernel': {' '.join(compiler)} could not build {SOURCE.name}: {why}")
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
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([*compiler, *flags, cpu_flags()]).encode()).hexdigest()[:16]
    return compiler, flags, cache_folder() / f"decode_attention_{real}_{key}.so"


@functools.cache
def load_kernel(real="float"):
    """-> the kernel's ctypes function computing in `real`, built at first use into cache_folder(). A cached
    library that does not load (cut short, say) is built again, once."""
    compiler, flags, library = library_for(real)
    try:
        if not library.exists():
            build(compiler, flags, library)
        try:
            kernel = ctypes.CDLL(str(library)).decode_attend
        except OSError:  # cut short or corrupt
            build(compiler, flags, library)
            kernel = ctypes.CDLL(str(library)).decode_attend
    except OSError as e:
        raise RuntimeError(f"compile 'kernel': cannot build or load {library}: {e}") from None
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    kernel.argtypes = [pointer] * 6 + [size] * 6 + [ctypes.c_double, ctypes.c_int, ctypes.c_int]
    kernel.restype = ctypes.c_int
    return kernel


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
    kernel = load_kernel(REAL[q.dtype])
    bf16 = int(q.dtype == torch.bfloat16)
    sizes = (B, table.shape[1], H, D, k_pool.shape[1], k_pool.shape[0])
    done = kernel(*(t.data_ptr() for t in tensors), *sizes, D**-0.5, bf16, torch.get_num_threads())
    if done == -2:
        raise ValueError(f"kernel_attend: a row's keys run past its table ({table.shape[1]} blocks) or the pool")
    if done:
        raise MemoryError(f"decode attention's scratch: {B} rows of {table.shape[1]} blocks")
    return out


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
    """A PagedEngine mixin: compile="kernel" runs decode attention on a CPU through ext/decode_attention.c."""

    compile_modes = ("auto", "on", "off", "kernel")

    def __init__(self, model, **kw):
        super().__init__(model, **kw)
        if self.compile == "kernel" and self.device.type != "cpu":
            raise ValueError("compile 'kernel' is a CPU kernel; on CUDA, ask for 'graph'")
        if self.compile == "kernel":
            try:  # built now, so that a missing compiler is said before any request runs, as a bad setting is
                load_kernel(REAL.get(self.kv_pool.dtype, "float"))
            except RuntimeError as e:
                raise ValueError(str(e)) from None
            self.batch_class = KernelBatch
