"""Which codecs a tier uses: ``KVFormat`` for one ``kv_cache_dtype`` (or ``host_kv_dtype``), what its session
records are called, and converting blocks between formats. The codecs themselves are in
``confkv/kv/quant.py`` (rows) and ``confkv/kv/block_keys.py`` (keys coded a block at a time)."""

from __future__ import annotations

import torch

from confkv.kv.block_keys import BlockKeyCodec, ChannelKeyCodec, Fp8KeyCodec
from confkv.kv.quant import KV_CACHE_DTYPES, Fp8Codec, GroupedCodec, Int8Codec, KVCodec


class KVFormat:
    """How one tier stores a block's K and V: ``auto`` (the model's dtype) or a quantised ``kv_cache_dtype``.

    Keys and values may use different codecs (int4: keys per channel within a block, values per token, as KIVI
    does), so their rows may differ in width. ``record_dtype`` names what the rows are in a session record; rows of
    one format mean nothing in another, so records of different formats are foreign to each other.
    """

    def __init__(self, kv_cache_dtype: str, head_dim: int, block_size: int, compute_dtype: torch.dtype) -> None:
        self.name = kv_cache_dtype
        self.head_dim = head_dim
        self.block_size = block_size
        self.compute_dtype = compute_dtype
        self.v_codec: KVCodec | None = codec_for(kv_cache_dtype)
        if self.v_codec is not None and (head_dim * self.v_codec.bits) % 8:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype}: head_dim {head_dim} does not pack into whole bytes")
        if self.v_codec is not None:  # a geometry the codec cannot lay out is refused here, not at the first write
            self.v_codec.encode(torch.zeros(1, head_dim))
        self.k_codec: KVCodec | BlockKeyCodec | None = self.v_codec
        if kv_cache_dtype == "int4":
            self.k_codec = ChannelKeyCodec(head_dim, block_size, outliers=ChannelKeyCodec.outliers_for(head_dim))
        elif kv_cache_dtype == "fp8":
            self.k_codec = Fp8KeyCodec(head_dim, block_size)
        #: The dtype of stored rows: bytes for a quantised format.
        self.storage_dtype = compute_dtype if self.v_codec is None else torch.uint8
        self.k_row = head_dim if self.k_codec is None else self.k_codec.row_bytes(head_dim)
        self.v_row = head_dim if self.v_codec is None else self.v_codec.row_bytes(head_dim)

    @property
    def quantised(self) -> bool:
        return self.v_codec is not None

    @property
    def record_dtype(self) -> str:
        """``"float32"`` (torch's spelling of the model's dtype) or ``"kv-int8"``, ``"kv-fp8m"``, ``"kv-int4o"``."""
        return str(self.compute_dtype).removeprefix("torch.") if self.v_codec is None else RECORD_DTYPES[self.name]

    def bytes_per_token(self, num_layers: int, num_kv_heads: int) -> int:
        """K and V bytes of one token; rows of the model's dtype count its element size."""
        el = torch.empty((), dtype=self.storage_dtype).element_size()
        return num_layers * num_kv_heads * (self.k_row + self.v_row) * el

    def encode_k(self, x: torch.Tensor, filled: torch.Tensor | None = None) -> torch.Tensor:
        """Whole blocks of keys ``[..., block_size, kv_heads, head_dim]`` -> stored rows. ``filled`` (rows written
        per block, ``[...]``) keeps a partly filled block's empty rows out of a per-channel grid."""
        if self.k_codec is None:
            return x.to(self.storage_dtype)
        if isinstance(self.k_codec, BlockKeyCodec):
            return self.k_codec.encode(x, filled)
        return self.k_codec.encode(x)

    def encode_v(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.storage_dtype) if self.v_codec is None else self.v_codec.encode(x)

    def decode_k(self, rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Stored rows of whole blocks ``[..., block_size, kv_heads, row]`` -> keys in ``dtype`` (the compute
        dtype by default); an ``auto`` format's rows themselves."""
        dtype = dtype or self.compute_dtype
        return rows if self.k_codec is None else self.k_codec.decode(rows, dtype)

    def decode_v(self, rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Stored rows ``[..., row]`` (any grouping: values are per token) -> values."""
        dtype = dtype or self.compute_dtype
        return rows if self.v_codec is None else self.v_codec.decode(rows, dtype)

    def convert_to(
        self, other: KVFormat, k: torch.Tensor, v: torch.Tensor, filled: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole blocks' rows ``[..., blocks, block_size, kv_heads, row]`` in this format re-encoded in ``other``
        (the rows themselves where both are the same format). ``filled`` (``[blocks]``: rows written in each) matters
        where ``other`` keys per channel: a sequence's last block is partly filled, and its empty rows (zeros) would
        otherwise widen every channel's grid."""
        if other.name == self.name and other.compute_dtype == self.compute_dtype:
            return k, v
        kf, vf = self.decode_k(k, torch.float32), self.decode_v(v, torch.float32)
        if filled is not None:
            filled = filled.to(kf.device).expand(kf.shape[:-3])
        return other.encode_k(kf.to(other.compute_dtype), filled), other.encode_v(vf.to(other.compute_dtype))


_CODECS: dict[str, type[KVCodec]] = {"int8": Int8Codec, "fp8": Fp8Codec, "int4": GroupedCodec}
#: A session record's dtype for each quantised ``kv_cache_dtype``. int4 is ``kv-int4o`` (keys per channel, a quarter
#: of a block's channels at 8 bits) and fp8 ``kv-fp8m`` (keys less their block's e4m3 mean per channel): the earlier
#: rows of each, recorded as ``kv-int4``, ``kv-int4c`` (keys per channel, all at 4 bits), ``kv-fp8`` and ``kv-fp8c``
#: (a float16 mean), are foreign to them.
RECORD_DTYPES: dict[str, str] = {"int8": "kv-int8", "fp8": "kv-fp8m", "int4": "kv-int4o"}


def codec_for(kv_cache_dtype: str) -> KVCodec | None:
    """The codec of a ``kv_cache_dtype``; ``None`` for ``auto`` (K and V stored as the model computes them)."""
    if kv_cache_dtype == "auto":
        return None
    try:
        return _CODECS[kv_cache_dtype]()
    except KeyError:
        raise ValueError(
            f"unknown kv_cache_dtype {kv_cache_dtype!r}: choose one of {', '.join(KV_CACHE_DTYPES)}"
        ) from None
