"""Layer 2 of the memory pool: hands out KV-cache pages.

Slots are grouped in pages of `page_size` tokens; page 0 (slots 0..page_size-1) is never handed
out: slot 0 is the sink that padded rows of a captured graph write their K/V into. The pool's layout
(`SlotLayout`) turns a page's slots into the slot numbers req_to_token records: `page_slots` and `pages_of`.
"""

import torch

from ostinato.mem.kv_cache import MHATokenToKVPool, SlotLayout, slot_group_for


def reserved_pages(page_size: int, slot_group: int = 0) -> int:
    """Pages never handed out: page 0 (the sink's), or the first slot group's pages where the pool's layout has
    groups (SlotLayout)."""
    return max(1, slot_group // page_size)


def paged_kv_pool(tokens: int, page_size: int, dtype: torch.dtype, head_num: int, head_dim: int, layer_num: int,
                  device: torch.device | str) -> tuple[MHATokenToKVPool, "TokenToKVPoolAllocator"]:
    """A KV pool and its allocator for `tokens` usable slots in pages of `page_size`, in the pool's default layout
    for the dtype (fp8: slot groups where the page size divides them, `slot_group_for`), the reserved pages on
    top."""
    group = slot_group_for(dtype, page_size)
    slots = (-(-tokens // page_size) + reserved_pages(page_size, group)) * page_size
    pool = MHATokenToKVPool(slots, dtype, head_num, head_dim, layer_num, device, slot_group=group)
    return pool, TokenToKVPoolAllocator(slots, page_size, device, pool.layout)


class TokenToKVPoolAllocator:
    def __init__(self, num_slots: int, page_size: int, device: torch.device | str,
                 layout: SlotLayout | None = None) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        layout = layout or SlotLayout()
        if layout.group % page_size:
            raise ValueError(f"page_size {page_size} must divide the KV pool's slot group of {layout.group}")
        self.layout = layout
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        # page 0, or with a slot group the whole first group, so that a request's slots start group-aligned
        self.reserved_pages = reserved_pages(page_size, layout.group)
        if self.num_pages <= self.reserved_pages:
            raise ValueError(
                f"max_total_tokens must hold at least {self.reserved_pages + 1} pages of page_size={page_size}, "
                f"got {num_slots}"
            )
        self.device = device
        # handed out from the front
        self._free = torch.arange(self.reserved_pages, self.num_pages, dtype=torch.int64, device=device)
        # pages freed since the last merge, appended to `_free` only when an allocation needs them: a free is
        # then one list append, not a copy of the whole free list (a step that finishes 256 requests frees 512
        # page ranges)
        self._returned: list[torch.Tensor] = []
        self._num_free = self.usable_pages

    def page_slots(self, pages: torch.Tensor) -> torch.Tensor:
        """The slot number of each page's first slot (its others follow it: a page lies in one slot group)."""
        return self.layout.numbers(pages * self.page_size if self.page_size > 1 else pages)

    def pages_of(self, first_slots: torch.Tensor) -> torch.Tensor:
        """The pages of slot numbers (`page_slots`' inverse for a page's first slot; any slot of a page maps to
        the page)."""
        return self.layout.slots(first_slots) // self.page_size

    @property
    def usable_pages(self) -> int:
        """Pages that can be handed out (the reserved ones excluded)."""
        return self.num_pages - self.reserved_pages

    @property
    def size(self) -> int:
        """Usable token slots (the reserved pages excluded)."""
        return self.usable_pages * self.page_size

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
