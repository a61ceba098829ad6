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
        self.free_pages = torch.arange(1, self.num_pages, dtype=torch.int64, device=device)

    @property
    def size(self) -> int:
        """Usable token slots (the reserved page excluded)."""
        return (self.num_pages - 1) * self.page_size

    def available_pages(self) -> int:
        return len(self.free_pages)

    def available_size(self) -> int:
        return len(self.free_pages) * self.page_size

    def alloc_pages(self, n: int) -> torch.Tensor | None:
        """`n` page ids, or None (and nothing taken) when fewer are free."""
        if n > len(self.free_pages):
            return None
        pages, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        return pages

    def free_pages_(self, pages: torch.Tensor) -> None:
        if pages.numel():
            self.free_pages = torch.cat([self.free_pages, pages.to(self.free_pages)])
