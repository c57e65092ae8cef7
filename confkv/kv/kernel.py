"""A fused C++ decode-attention kernel over a quantised pool's codes (int8, fp8, int4) on the CPU.

The torch paths (``folded.py`` for int8/fp8, decode-then-SDPA for int4) first turn every gathered code into a float
in several whole passes over the keys and values (fp8's bit trick, int4's nibbles), then multiply. This kernel
(``decode_kernel.cpp``) reads each sequence's blocks through the block table and dequantises one key or value row
at a time into a buffer that stays in L1, scores it against the KV head's group of queries, and accumulates the
values with their probabilities: the codes are read once, and masked slots (unfilled tails, padding, keys outside a
sliding window) not at all. Sequences x KV heads run in parallel on torch's intra-op threads (``at::parallel_for``).
Under a float window (``confkv/kv/window.py``) a block with an exact copy is read from the window's arena instead of
its codes (the rows the torch path's ``FloatWindow.read_into`` overwrites: whole blocks), so ``fp8``/``int4`` with
``--kv-float-window`` take the kernel too; the arena must be float32 (a bf16/fp16 model's window keeps the torch
path). Each call also returns every query's log-sum-exp (``decode_attention_lse``): a sequence that may recall keeps
its query and that value to rank host blocks, so a confidence rule's steps take the kernel too.

It is built once per machine with ``torch.utils.cpp_extension.load_inline`` into ``$CONFKV_CACHE/kernels`` (default
``~/.cache/confkv/kernels``), with ``-O3 -march=native``: the module's name carries a hash of the source, the flags,
the torch version and this CPU's model and feature flags, so another CPU (or another source) compiles its own.
If the build fails (no compiler, say) one warning is logged and the torch path is used from then on; the switch
``CONFKV_DECODE_KERNEL=0`` (or ``confkv.kv.attention.DECODE_KERNEL = False``) turns the kernel off.

It computes the same attention as the torch path in a different order of float32 operations (scales folded into
scores and probabilities as in ``folded.py``, a polynomial ``exp``): equal within float32 rounding, not bit for bit
(``tests/test_kv_kernel.py`` holds it to that).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
from pathlib import Path
from types import ModuleType

import torch

from confkv.config import cache_root
from confkv.kv.block_keys import ChannelKeyCodec, Fp8KeyCodec
from confkv.kv.pool import BlockPool
from confkv.kv.quant import Fp8Codec, GroupedCodec, Int8Codec
from confkv.progress import stage

log = logging.getLogger(__name__)

#: The source, shipped beside this module.
SOURCE = Path(__file__).with_name("decode_kernel.cpp")
#: Compiler flags: ``-march=native`` is safe only because the module name (the build cache's key) includes the CPU.
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
#: The environment switch: ``0``, ``off``, ``false`` or ``no`` turns the kernel off for the process.
ENV = "CONFKV_DECODE_KERNEL"

#: How long the first build took on a 2-core AMD EPYC (26.8 s): the progress estimate while it compiles.
_BUILD_EXPECTED_S = 30.0

#: The kernel's format codes (``decode_kernel.cpp``'s ``Format``).
_INT8, _FP8, _INT4 = 0, 1, 2

_module: ModuleType | None = None
_failed = False


def enabled_by_env() -> bool:
    """Whether ``$CONFKV_DECODE_KERNEL`` leaves the kernel on (unset: on)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def _format(pool: BlockPool) -> int | None:
    """The kernel's code for the pool's format, or None where it has none (``auto``, mixed codecs)."""
    k, v = pool.fmt.k_codec, pool.fmt.v_codec
    if isinstance(v, Int8Codec) and isinstance(k, Int8Codec):
        return _INT8
    if isinstance(v, Fp8Codec) and isinstance(k, Fp8KeyCodec):
        return _FP8
    if isinstance(v, GroupedCodec) and isinstance(k, ChannelKeyCodec) and v.bits == k.bits == 4:
        return _INT4
    return None


def _outliers(pool: BlockPool) -> int:
    """int4 keys' outlier channels per block (``ChannelKeyCodec.outliers``); 0 for the other formats."""
    k = pool.fmt.k_codec
    return k.outliers if isinstance(k, ChannelKeyCodec) else 0


def supported(pool: BlockPool) -> bool:
    """Whether the kernel reads this pool: int8, fp8 or int4 on the CPU (on a GPU the torch path stays), without a
    float window or with a float32 one (the kernel reads the arena's rows as float32), and the build has not failed
    in this process."""
    window_ok = pool.window is None or pool.window.k.dtype == torch.float32
    return not _failed and pool.device.type == "cpu" and _format(pool) is not None and window_ok


def _cpu_key() -> str:
    """This CPU's model and feature flags (what ``-march=native`` compiles for)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine() + platform.processor()
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))]
    return platform.machine() + "\n".join(sorted(set(lines)))


def module_name(source: str) -> str:
    """The build's name: one per source, flags, torch version, Python and CPU (a change of any rebuilds)."""
    key = "\0".join([source, " ".join(CFLAGS), torch.__version__, platform.python_version(), _cpu_key()])
    return "confkv_decode_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def load() -> ModuleType | None:
    """The built kernel (compiled on the first call in a machine's cache, imported after); None, with one
    warning per process, if it cannot be built."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    try:
        from torch.utils.cpp_extension import load_inline

        source = SOURCE.read_text()
        name = module_name(source)
        build = cache_root() / "kernels" / name
        build.mkdir(parents=True, exist_ok=True)
        fresh = not (build / f"{name}.so").exists()  # a compile (half a minute) rather than an import
        shown = "building the C++ decode-attention kernel (once)"
        with stage(shown, expected_s=_BUILD_EXPECTED_S) if fresh else contextlib.nullcontext():
            _module = load_inline(name=name, cpp_sources=[source], functions=["decode_attention", "vectorised"],
                                  extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"], build_directory=str(build),
                                  verbose=False)  # fmt: skip
    except Exception as err:  # a compiler or loader failure of any kind: the torch path serves instead
        _failed = True
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        log.warning("the C++ decode-attention kernel could not be built (%s); using the torch path", first[:200])
        return None
    return _module


def decode_attention(
    pool: BlockPool,
    layer: int,
    blocks: torch.Tensor,
    qg: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
    arena: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Attention of decode queries ``qg`` ``[n, kvh, g, D]`` over the rows' ``blocks`` ``[n, max_blocks]`` of
    ``layer``, keys ``valid`` ``[n, max_blocks * block_size]`` (masked slots are not read). ``arena`` ``[n,
    max_blocks]``: each gathered block's block in the pool's float window (``FloatWindow.index`` of ``blocks``),
    ``-1`` where its codes are read; None reads codes only. Returns ``[n, kvh, g, D]`` in ``qg``'s dtype, or None
    where the kernel is not available (the caller takes the torch path)."""
    both = decode_attention_lse(pool, layer, blocks, qg, valid, scaling, arena)
    return None if both is None else both[0]


def decode_attention_lse(
    pool: BlockPool,
    layer: int,
    blocks: torch.Tensor,
    qg: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
    arena: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``decode_attention``'s output and each query's log-sum-exp of its scaled scores ``[n, kvh, g]`` (float32):
    what a sequence that may recall keeps of its step (``Captures``), so it too takes the kernel. The kernel
    computes both in every call (the log-sum-exp is one ``log`` per query); None where it is not available."""
    fmt = _format(pool)
    mod = load() if fmt is not None and pool.device.type == "cpu" else None
    if mod is None:
        return None
    if arena is not None:
        window = pool.window
        if window is None or window.k.dtype != torch.float32:
            return None  # a bf16/fp16 arena: the torch path reads it
        wk, wv, arena = window.k[layer], window.v[layer], arena.to(torch.long).contiguous()
    else:
        wk = wv = _NO_ARENA
        arena = _NO_INDEX
    out, lse = mod.decode_attention(pool.k[layer], pool.v[layer], blocks.to(torch.long).contiguous(),
                                    valid.to(torch.bool).contiguous(), qg.to(torch.float32).contiguous(),
                                    float(scaling), fmt, pool.block_size, _outliers(pool), wk, wv, arena)  # fmt: skip
    return out.to(qg.dtype), lse


#: What the kernel receives where no float window is read (its "no arena").
_NO_ARENA = torch.empty((0, 0, 0), dtype=torch.float32)
_NO_INDEX = torch.empty((0, 0), dtype=torch.long)
