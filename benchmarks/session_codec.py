"""How well a session record compresses, on KV computed by the model from real text.

    python benchmarks/session_codec.py --model tiny-random --tokens 1024
    python benchmarks/session_codec.py --model smollm2-135m --tokens 2000

The repository's README (repeated if short) is tokenised and run through the model once with Hugging Face's cache;
its keys (after RoPE, as the engine's pool stores them) and values are cut into blocks of ``--block-size`` and
encoded as a ``SessionRecord`` in each KV dtype (float32 as computed; bfloat16 and float16 cast from it; and the
packed rows a pool of ``kv_cache_dtype`` int8, fp8 or int4 holds, records ``kv-int8``, ``kv-fp8m``, ``kv-int4o``) at
zstd levels 1, 3 and 9. Scores are uniform random float32 (attention sums have random-looking mantissas too; 4 bytes a
token either way). Reported per dtype and level: ratio = safetensors bytes / zstd payload bytes, the record's size
over the raw K+V bytes, its bytes, and encode/decode time.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from common import load, parser, report, setup

from confkv.kv.kv_format import KVFormat
from confkv.sessions import BlockKV, SessionRecord, decode, encode, model_fingerprint, read_header

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--levels", default="1,3,9")
    args = p.parse_args()
    device, env = setup(args)
    loaded = load(args, device)
    text = (ROOT / "README.md").read_text()
    ids: list[int] = []
    while len(ids) < args.tokens:
        ids += loaded.tokenizer(text)["input_ids"]
    ids = ids[: args.tokens]
    with torch.no_grad():
        out = loaded.model(torch.tensor([ids], device=device), use_cache=True)
    layers = out.past_key_values.layers
    k = torch.stack([layer.keys[0] for layer in layers]).transpose(1, 2).float().cpu()  # [L, T, H, D]
    v = torch.stack([layer.values[0] for layer in layers]).transpose(1, 2).float().cpu()
    bs = args.block_size
    n_blocks = len(ids) // bs
    fp = model_fingerprint(loaded.model, loaded.tokenizer)
    result: dict = {**env, "tokens": n_blocks * bs, "block_size": bs, "kv_shape": list(k.shape)}
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand(n_blocks, bs, generator=gen)
    k, v = k[:, : n_blocks * bs], v[:, : n_blocks * bs]
    forms = {
        str(d).removeprefix("torch."): (lambda x, d=d: x.to(d)) for d in (torch.float32, torch.bfloat16, torch.float16)
    }
    packed: dict[str, KVFormat] = {}
    for kv_dtype in ("int8", "fp8", "int4"):  # the rows a quantised pool holds (int4 keys: per channel of a block)
        fmt = KVFormat(kv_dtype, k.shape[-1], bs, torch.float32)
        packed[fmt.record_dtype] = fmt
        forms[fmt.record_dtype] = fmt.encode_v
    for record_dtype, form in forms.items():
        if record_dtype in packed:
            by_block = k.reshape(k.shape[0], n_blocks, bs, *k.shape[2:])
            kq, vq = packed[record_dtype].encode_k(by_block).flatten(1, 2), form(v)
        else:
            kq, vq = form(k), form(v)
        blocks = {
            i: BlockKV(k=kq[:, i * bs : (i + 1) * bs], v=vq[:, i * bs : (i + 1) * bs], score=scores[i])
            for i in range(n_blocks)
        }
        rec = SessionRecord(
            session_id="codec",
            model_fingerprint=fp,
            block_size=bs,
            dtype=record_dtype,
            token_ids=ids[: n_blocks * bs],
            num_computed=n_blocks * bs,
            blocks=blocks,
        )
        name = rec.dtype
        for level in (int(x) for x in args.levels.split(",")):
            t0 = time.perf_counter()
            blob = encode(rec, level=level)
            t1 = time.perf_counter()
            decode(blob)
            t2 = time.perf_counter()
            header = read_header(blob)
            result[f"{name}_l{level}_ratio"] = header["raw_bytes"] / header["payload_bytes"]
            result[f"{name}_l{level}_record_over_kv"] = len(blob) / rec.kv_bytes
            result[f"{name}_l{level}_record_bytes"] = len(blob)
            result[f"{name}_l{level}_encode_ms"] = (t1 - t0) * 1e3
            result[f"{name}_l{level}_decode_ms"] = (t2 - t1) * 1e3
        result[f"{name}_kv_bytes"] = rec.kv_bytes
    report(args, result)


if __name__ == "__main__":
    main()
