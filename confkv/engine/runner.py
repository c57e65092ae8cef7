"""Runs one forward pass of the unmodified model over a packed batch of scheduled chunks.

All tokens of all sequences go in one row with their true positions; a ``PackedBatch`` tells the attention
function where each token's K/V goes and which resident slots each sequence attends over. Only the rows whose
logits are needed (the last token of sequences that sample) go through the LM head. What each sequence's attention
records (for block importance) follows that sequence's own controller. The attention mass a pass records reaches the
pool only when ``commit`` is called after the pass succeeded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from confkv.engine.scheduler import ScheduledChunk
from confkv.kv.attention import PackedBatch, PrefillSpan, sdpa_backends
from confkv.kv.demoted import DemotedKeys, DemotedTier
from confkv.kv.pool import BlockPool


@dataclass
class ForwardResult:
    logits: torch.Tensor  # [sampling chunks, vocab], in the order of ``sampling``
    sampling: list[ScheduledChunk]
    batch: PackedBatch
    resident: list[int]  # per chunk: resident tokens (including the chunk's own) during this pass
    captured: dict[int, int]  # sequence id -> row of ``batch.captured_q[layer]``
    spans: list[tuple[int, int]]  # per chunk: (first row of ``logits``, number of rows), (.., 0) when none


class ModelRunner:
    def __init__(self, model: PreTrainedModel, pool: BlockPool, demoted: DemotedTier | None = None) -> None:
        self.model = model
        self.pool = pool
        self.device = pool.device
        self.demoted = demoted

    def _demoted(self, seq_id: int, num_tokens: int) -> DemotedKeys | None:
        if self.demoted is None or not self.demoted.has_blocks(seq_id):
            return None
        return self.demoted.gather(seq_id, num_tokens)

    @torch.inference_mode()
    def run(
        self,
        chunks: list[ScheduledChunk],
        *,
        track: bool = True,
        capture: set[int] | None = None,
        all_rows: set[int] | frozenset[int] = frozenset(),
    ) -> ForwardResult:
        """Forward ``chunks`` (decodes first: single tokens after the prompt, ``ScheduledChunk.decodes``).

        ``track``: record attention mass for policies that rank blocks by it. ``capture``: sequence ids whose
        sampling query and log-sum-exp are kept for recall scoring. ``all_rows``: return logits for every
        token of these sequences' chunks (teacher-forced scoring), not only the last one of sampling chunks.
        """
        capture = capture or set()
        device = self.device
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        resident: list[int] = []
        decode_blocks: list[tuple[list[int], list[int]]] = []  # per decode row: (device block ids, logical indices)
        decode_decay: list[tuple[int, float]] = []  # decode rows that scale their slots' previous mass, and by what
        decode_qpos: list[int] = []
        decay: list[tuple[torch.Tensor, float]] = []  # slots whose previous mass this pass scales before adding
        decode_track: list[float] = []
        decode_demoted: list[tuple[int, int, DemotedKeys]] = []  # (decode row, sequence id, its demoted blocks)
        prefills: list[PrefillSpan] = []
        sample_rows: list[int] = []
        spans: list[tuple[int, int]] = []
        sampling: list[ScheduledChunk] = []
        capture_decode = False
        prefill_captures: list[int] = []
        float_window = self.pool.window if self.pool.window is not None and self.pool.window.num_blocks else None

        for chunk in chunks:
            seq, start, n = chunk.seq, chunk.start, chunk.num_tokens
            table, controller = seq.kv.table, seq.kv.controller
            row = len(ids)
            ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            slots.extend(table.slots(start, start + n))
            resident.append(table.resident_tokens(start + n))
            if seq.seq_id in all_rows:
                spans.append((len(sample_rows), n))
                sample_rows.extend(range(row, row + n))
            elif chunk.samples:
                spans.append((len(sample_rows), 1))
                sample_rows.append(row + n - 1)
            else:
                spans.append((len(sample_rows), 0))
            if chunk.samples:
                sampling.append(chunk)
            recorded = track and not chunk.rerun  # a rerun's attention was recorded by its first pass
            decode_mode = controller.decode_attention if recorded else "none"
            factor = controller.decode_decay
            if chunk.decodes:
                if decode_mode != "none" and factor < 1.0:
                    decode_decay.append((len(decode_blocks), factor))
                if (demoted := self._demoted(seq.seq_id, start + n)) is not None:
                    decode_demoted.append((len(decode_blocks), seq.seq_id, demoted))
                decode_blocks.append(table.resident_blocks(start + n))
                decode_qpos.append(start)
                decode_track.append(0.0 if decode_mode == "none" else 1.0)
                capture_decode = capture_decode or seq.seq_id in capture
            else:
                key_slots, key_pos = table.resident_slots(start + n, "cpu")
                window_plan = float_window.rows_of(key_slots) if float_window is not None and start > 0 else None
                key_slots, key_pos = key_slots.to(device, non_blocking=True), key_pos.to(device, non_blocking=True)
                demoted = self._demoted(seq.seq_id, start + n) if start > 0 else None
                if chunk.samples and seq.seq_id in capture:
                    prefill_captures.append(seq.seq_id)
                mode = controller.prefill_attention if recorded else "none"
                window = controller.prefill_window
                end = start + n
                window_start = seq.num_prompt_tokens - window  # the prompt's last window
                if start >= seq.num_prompt_tokens:  # a teacher-forced chunk of output: decode-time rules
                    # a decayed record counts the chunk's queries alike and decays what came before by n steps
                    mode, window = {
                        "none": ("none", 0),
                        "accumulate": ("all", 0),
                        "replace": ("window", 1),
                        "decay": ("window", n),
                    }[decode_mode]
                    window_start = end - window
                    if decode_mode != "none" and factor < 1.0:
                        decay.append((key_slots, factor**n))
                elif mode == "window":
                    if end <= window_start:
                        # the chunk ends before the prompt's last window: its own last queries vote, so the
                        # prompt can be trimmed before it is whole; the next chunk's vote replaces this one
                        window_start = end - window
                        decay.append((key_slots, 0.0))
                    elif start <= max(window_start, 0) or decode_mode == "replace":
                        decay.append((key_slots, 0.0))  # the prompt's last window begins here: earlier votes go
                prefills.append(
                    PrefillSpan(
                        q_start=row,
                        q_len=n,
                        key_slots=key_slots,
                        key_pos=key_pos,
                        q_pos=torch.arange(start, start + n, device=device),
                        fresh=start == 0,
                        track=mode,
                        window_start=window_start,
                        capture=chunk.samples and seq.seq_id in capture,
                        demoted=None if demoted is None else (self.demoted.format(seq.seq_id), demoted),
                        window=window_plan,
                    )
                )

        slot_mapping = torch.tensor(slots, dtype=torch.long)
        batch = PackedBatch(pool=self.pool, slot_mapping=slot_mapping.to(device), prefills=prefills)
        if float_window is not None:
            batch.window_store = float_window.rows_of(slot_mapping)
        if decode_blocks:
            nd = len(decode_blocks)
            bs = self.pool.block_size
            width = max(len(b) for b, _ in decode_blocks)
            # padding repeats a row's last block (a real one) and is masked out by ``valid``
            blocks = torch.tensor([b + b[-1:] * (width - len(b)) for b, _ in decode_blocks], dtype=torch.long)
            logical = torch.tensor([i + i[-1:] * (width - len(i)) for _, i in decode_blocks], dtype=torch.long)
            filled = torch.tensor([len(b) for b, _ in decode_blocks], dtype=torch.long)
            qpos = torch.tensor(decode_qpos, dtype=torch.long)
            offsets = torch.arange(bs)
            key_pos = (logical[:, :, None] * bs + offsets).reshape(nd, width * bs)
            real = (torch.arange(width)[None, :] < filled[:, None]).repeat_interleave(bs, dim=1)
            valid = real & (key_pos <= qpos[:, None])
            batch.num_decode = nd
            batch.decode_blocks = blocks.to(device)
            batch.decode_valid = valid.to(device)
            batch.decode_pos = key_pos.to(device)
            batch.decode_qpos = qpos.to(device)
            batch.capture_decode = capture_decode
            if float_window is not None:  # the gathered blocks, in gathered order
                batch.decode_window = float_window.blocks_of(blocks.reshape(-1))
                if batch.decode_window is not None:  # the same, per block, for the C++ decode kernel
                    batch.decode_arena = float_window.index[blocks].to(device)
            if decode_demoted:
                self._pack_demoted(batch, decode_demoted, nd, qpos)
            if any(decode_track):  # slots only where attention mass is recorded per slot
                key_slots = (blocks[:, :, None] * bs + offsets).reshape(nd, width * bs)
                decay.extend((key_slots[r][valid[r]].to(device), f) for r, f in decode_decay)
                batch.decode_slots = key_slots.to(device)
                batch.decode_track = torch.tensor(decode_track, device=device)[:, None]
        if (batch.decode_track is not None) or any(p.track != "none" for p in prefills):
            batch.score = torch.zeros_like(self.pool.score)
            if decay:
                batch.decay_slots = torch.cat([slots for slots, _ in decay])
                batch.decay_factors = torch.cat(
                    [torch.full((len(slots),), f, dtype=batch.score.dtype, device=device) for slots, f in decay]
                )

        input_ids = torch.tensor([ids], dtype=torch.long, device=device)
        position_ids = torch.tensor([positions], dtype=torch.long, device=device)
        keep = torch.tensor(sample_rows, dtype=torch.long, device=device)
        with sdpa_backends(device):
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                use_cache=False,
                logits_to_keep=keep,
                confkv_batch=batch,
            )
        # captured rows: every decode row (when any decode captures), then each capturing prefill span
        captured: dict[int, int] = {}
        if capture_decode:
            captured.update((c.seq.seq_id, r) for r, c in enumerate(chunks[: len(decode_blocks)]))
        offset = len(captured)
        for r, sid in enumerate(prefill_captures):
            captured[sid] = offset + r
        return ForwardResult(
            logits=out.logits[0], sampling=sampling, batch=batch, resident=resident, captured=captured, spans=spans
        )

    def _pack_demoted(
        self, batch: PackedBatch, rows: list[tuple[int, int, DemotedKeys]], nd: int, qpos: torch.Tensor
    ) -> None:
        """The decode rows' demoted blocks as zero-padded ``[layers, g, width, kv_heads, row]`` per format (whole
        blocks: ``width`` is a multiple of the block size, as a per-channel key grid needs)."""
        assert self.demoted is not None
        device = self.device
        width = max(d.pos.numel() for _, _, d in rows)
        valid = torch.zeros(nd, width, dtype=torch.bool)
        pos = torch.zeros(nd, width, dtype=torch.long)
        groups: dict[str, list[tuple[int, DemotedKeys]]] = {}
        for r, sid, d in rows:
            t = d.pos.numel()
            valid[r, :t] = d.pos.cpu() <= qpos[r]
            pos[r, :t] = d.pos.cpu()
            groups.setdefault(self.demoted.format(sid).name, []).append((r, d))
        for members in groups.values():
            sid = next(s for r, s, _ in rows if r == members[0][0])
            k = torch.zeros((self.pool.num_layers, len(members), width, *members[0][1].k.shape[2:]),
                            dtype=torch.uint8, device=device)  # fmt: skip
            v = k.new_zeros((*k.shape[:-1], members[0][1].v.shape[-1]))  # value rows: their own width
            for j, (_, d) in enumerate(members):
                k[:, j, : d.pos.numel()] = d.k
                v[:, j, : d.pos.numel()] = d.v
            index = torch.tensor([r for r, _ in members], dtype=torch.long, device=device)
            batch.decode_demoted.append((self.demoted.format(sid), index, k, v))
        batch.decode_demoted_valid = valid.to(device)
        batch.decode_demoted_pos = pos.to(device)

    def commit(self, res: ForwardResult) -> None:
        """Add the attention mass the pass recorded to what scorers read (only once the pass has succeeded),
        first scaling down what was recorded before where the scorer decays it (to zero where it replaces it)."""
        batch = res.batch
        if batch.score is not None:
            if batch.decay_slots is not None:
                score, slots = self.pool.score, batch.decay_slots
                score.index_copy_(0, slots, score.index_select(0, slots) * batch.decay_factors)
            self.pool.score.add_(batch.score)
