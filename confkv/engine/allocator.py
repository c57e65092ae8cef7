"""Keep the C allocator from handing freed tensor memory back to the OS between decode steps.

Each decode step allocates and frees the same few large buffers per layer (the gathered keys and values, the
attention scores). glibc's default malloc returns freed memory at the top of the heap once more than its trim
threshold is free (and serves large requests with fresh ``mmap`` pages), so a step can fault the same memory in
again, every step. ``benchmarks/decode_step.py`` reports the page faults per step of any configuration.
PyTorch's CPU tuning guide makes the same point and suggests preloading jemalloc or tcmalloc; fixing glibc's two
thresholds gets the same effect with no extra library. It is process-wide, done once, and only on glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: Requests up to this size come from the heap (reused) rather than fresh ``mmap`` pages.
MMAP_THRESHOLD = 64 << 20
#: Free memory kept at the top of the heap before any is given back.
TRIM_THRESHOLD = 512 << 20

_done = False


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds once per process; False where there is no glibc (nothing to do)."""
    global _done
    if _done:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = (
            libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
            and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
        )
    except (OSError, AttributeError):
        ok = False
    if not ok:
        log.debug("mallopt refused the thresholds; decode steps may page-fault their buffers in each step")
    _done = ok
    return ok
