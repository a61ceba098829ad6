"""Layer 2 of the memory pool: hands out KV-cache pages.

Slots are grouped in pages of `page_size` tokens; page 0 (slots 0..page_size-1) is never handed
out: slot 0 is the sink that padded rows of a captured graph write their K/V into.
"""

import torch


class TokenToKVPoolAllocator:
    def __init__(self, num_slots: int, page_size: int, device: torch.device | str) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        if self.num_pages < 2:
            raise ValueError(
                f"max_total_tokens must hold at least 2 pages of page_size={page_size}, got {num_slots}"
            )
        self.device = device
        self._free = torch.arange(1, self.num_pages, dtype=torch.int64, device=device)  # handed out from the front
        # pages freed since the last merge, appended to `_free` only when an allocation needs them: a free is
        # then one list append, not a copy of the whole free list (a step that finishes 256 requests frees 512
        # page ranges)
        self._returned: list[torch.Tensor] = []
        self._num_free = self.num_pages - 1

    @property
    def size(self) -> int:
        """Usable token slots (the reserved page excluded)."""
        return (self.num_pages - 1) * self.page_size

    @property
    def free_pages(self) -> torch.Tensor:
        """Every free page id, in the order they will be handed out."""
        self._merge()
        return self._free

    @free_pages.setter
    def free_pages(self, pages: torch.Tensor) -> None:  # (tests reorder the free list)
        self._free, self._returned, self._num_free = pages, [], len(pages)

    def _merge(self) -> None:
        if self._returned:
            self._free = torch.cat([self._free, *self._returned])
            self._returned = []

    def available_pages(self) -> int:
        return self._num_free

    def available_size(self) -> int:
        return self._num_free * self.page_size

    def alloc_pages(self, n: int) -> torch.Tensor | None:
        """`n` page ids, or None (and nothing taken) when fewer are free."""
        if n > self._num_free:
            return None
        if n > len(self._free):
            self._merge()
        pages, self._free = self._free[:n], self._free[n:]
        self._num_free -= n
        return pages

    def free_pages_(self, pages: torch.Tensor) -> None:
        if pages.numel():
            self._returned.append(pages.to(self._free))
            self._num_free += pages.numel()
