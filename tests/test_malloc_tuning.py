"""malloc_tuning: glibc takes every setting, and with them a large CPU tensor comes from the heap
(reused memory) instead of a fresh mmap (pages the kernel zero-fills on first touch).

    pytest -q tests/test_malloc_tuning.py
"""
import ctypes.util
import subprocess
import sys

import pytest

from trainer import malloc_tuning
from conftest import ROOT


def glibc() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        return hasattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), "gnu_get_libc_version")
    except OSError:
        return False


needs_glibc = pytest.mark.skipif(not glibc(), reason="mallopt is glibc's: elsewhere keep_freed_memory is a no-op")

# in a fresh process (the settings last for the process): is a 20 MB tensor served by a fresh
# mmap (glibc's default above 128 KB, before any large block was freed) or from the heap?
# Prints the change in mallinfo2's count of mmapped blocks (hblks).
MMAPPED = """
import ctypes, ctypes.util, sys, torch
from trainer import malloc_tuning
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "tuned":
    assert malloc_tuning.keep_freed_memory()
before = libc.mallinfo2().hblks
x = torch.empty(20 << 20, dtype=torch.uint8)
print(libc.mallinfo2().hblks - before)
"""


@needs_glibc
def test_glibc_takes_every_setting():
    code = "import sys; from trainer import malloc_tuning; sys.exit(0 if malloc_tuning.keep_freed_memory() else 1)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


@needs_glibc
def test_large_tensors_come_from_the_heap_not_a_fresh_mmap():
    def new_mmaps(mode):
        out = subprocess.run([sys.executable, "-c", MMAPPED, mode], cwd=ROOT, capture_output=True, text=True)
        if "mallinfo2" in out.stderr:  # glibc < 2.33
            pytest.skip("this glibc has no mallinfo2")
        assert out.returncode == 0, out.stderr[-2000:]
        return int(out.stdout.split()[-1])
    assert new_mmaps("default") == 1  # the control: glibc's default maps it afresh
    assert new_mmaps("tuned") == 0


def test_not_glibc_is_a_no_op():
    if glibc():
        pytest.skip("this platform has glibc: the other tests cover it")
    assert malloc_tuning.keep_freed_memory() is False
