"""Where each of a sequence's logical blocks lives.

Logical block ``i`` holds the tokens at positions ``[i * block_size, (i + 1) * block_size)``. Its entry is a device
block id (``>= 0``), ``ON_HOST`` (evicted to the host tier, recallable) or ``DROPPED`` (gone for good).
"""

from __future__ import annotations

import torch

ON_HOST = -1
DROPPED = -2


class BlockTable:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.entries: list[int] = []
        #: Tokens whose slots exist (computed, or reserved for the step being run).
        self.num_tokens = 0
        #: The first logical block that may still hold a float-window copy (``confkv/kv/window.py``): the blocks
        #: before it have left the window.
        self.window_from = 0

    def __len__(self) -> int:
        return len(self.entries)

    def blocks_for(self, num_tokens: int) -> int:
        """Logical blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def device_blocks(self) -> list[int]:
        return [b for b in self.entries if b >= 0]

    def resident_indices(self) -> list[int]:
        return [i for i, b in enumerate(self.entries) if b >= 0]

    def host_indices(self) -> list[int]:
        return [i for i, b in enumerate(self.entries) if b == ON_HOST]

    def tokens_in(self, idx: int, num_tokens: int | None = None) -> int:
        n = self.num_tokens if num_tokens is None else num_tokens
        return max(0, min(self.block_size, n - idx * self.block_size))

    def resident_tokens(self, num_tokens: int | None = None) -> int:
        """Tokens on the device among the first ``num_tokens`` (default all with slots)."""
        n = self.num_tokens if num_tokens is None else num_tokens
        full = self.blocks_for(n)
        count = sum(1 for b in self.entries[:full] if b >= 0) * self.block_size
        if full and self.entries[full - 1] >= 0:
            count -= full * self.block_size - n
        return count

    def slot(self, pos: int) -> int:
        return self.entries[pos // self.block_size] * self.block_size + pos % self.block_size

    def slots(self, start: int, stop: int) -> list[int]:
        bs = self.block_size
        return [self.entries[p // bs] * bs + p % bs for p in range(start, stop)]

    def resident_blocks(self, num_tokens: int) -> tuple[list[int], list[int]]:
        """Device block ids and logical indices of the resident blocks among the first ``num_tokens`` tokens.

        Decode attention gathers whole blocks (one contiguous copy each) and masks the unfilled tail by position,
        which costs half of gathering the same tokens slot by slot."""
        full = self.blocks_for(num_tokens)
        idx = [i for i in range(full) if self.entries[i] >= 0]
        return [self.entries[i] for i in idx], idx

    def resident_slots(self, num_tokens: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots and true positions of the resident tokens among the first ``num_tokens``, in position order."""
        bs = self.block_size
        full = self.blocks_for(num_tokens)
        blocks, idx = self.resident_blocks(num_tokens)
        ids = torch.tensor(blocks, dtype=torch.long)
        offsets = torch.arange(bs)
        slots = (ids[:, None] * bs + offsets).reshape(-1)
        pos = (torch.tensor(idx, dtype=torch.long)[:, None] * bs + offsets).reshape(-1)
        if idx and idx[-1] == full - 1:
            keep = slots.numel() - (full * bs - num_tokens)
            slots, pos = slots[:keep], pos[:keep]
        return slots.to(device, non_blocking=True), pos.to(device, non_blocking=True)
