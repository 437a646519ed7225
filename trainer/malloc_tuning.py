"""glibc malloc settings for CPU tensors: reuse freed memory instead of page-faulting fresh memory.

glibc serves every allocation above its mmap threshold (128 KB at start, raised as large blocks
are freed, at most 32 MB) with a fresh mmap, unmapped again on free, and hands the heap's free
top back to the OS past its trim threshold. A CPU forward allocates and frees tensors of 1-30 MB
in every layer (a decode step's gathered K/V at 512 rows: 10 MB per layer and K or V), and many
of them arrive as fresh pages, which the kernel zero-fills on first touch: often a cost above
that of the kernel that fills the tensor. Fixed thresholds (mmap at 32 MB, glibc's documented maximum on
64-bit, a 1 GB trim threshold, a 256 MB top pad) keep such blocks in the heap for the next step.
Measured on the tiny config (a 2-core VM, 1 thread): a decode layer's gather + attention at 512
rows 14.7 -> 6.9 ms at worst (glibc's own threshold sometimes gets there: 8.4 ms); a rollout of
32 prompts x 8 from the warm start 1.11x faster (bench/malloc_tuning.py, fresh processes in
turn); an SFT step no faster (0.98x). train.py and eval.py call it on CPU runs only (device
memory has its own allocator); the freed memory a process keeps for reuse is at most the trim
threshold.

    from trainer import malloc_tuning; malloc_tuning.keep_freed_memory()   # once, at the start of a process

Same as MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1073741824 MALLOC_TOP_PAD_=268435456
in the environment. A no-op (returns False) off glibc (macOS, musl).
Tests: pytest tests/test_malloc_tuning.py
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS = {M_MMAP_THRESHOLD: 32 << 20, M_TRIM_THRESHOLD: 1 << 30, M_TOP_PAD: 256 << 20}


def keep_freed_memory() -> bool:
    """Set SETTINGS with mallopt. True if glibc took every one of them."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in SETTINGS.items())
