import pytest
import torch
from batch_helpers import record_slots

from ostinato.mem.kv_cache import FP8_SLOT_GROUP, MHATokenToKVPool, SlotLayout
from ostinato.mem.kv_manager import KVManager
from ostinato.mem.req_to_token_pool import ReqToTokenPool
from ostinato.mem.token_allocator import TokenToKVPoolAllocator


def make(num_pages: int, page: int, reqs: int = 8, ctx: int = 256, layout: SlotLayout | None = None) -> KVManager:
    return KVManager(ReqToTokenPool(reqs, ctx, "cpu"), TokenToKVPoolAllocator(num_pages * page, page, "cpu", layout))


@pytest.mark.parametrize("page", [1, 4, 16])
def test_extend_grows_pages_and_never_hands_out_the_sink(page):
    kv = make(64, page)
    gen = torch.Generator().manual_seed(page)
    slots = [kv.req_pool.alloc() for _ in range(4)]
    lens = [0] * 4
    for _ in range(30):  # random interleaved growth, like chunked prefill + decode
        i = int(torch.randint(4, (1,), generator=gen))
        n = int(torch.randint(1, 9, (1,), generator=gen))
        if kv.allocator.available_pages() < kv.pages_needed(lens[i], lens[i] + n):
            assert kv.extend(slots[i], lens[i], lens[i] + n) is None  # refused, nothing taken
            continue
        loc = kv.extend(slots[i], lens[i], lens[i] + n)
        assert loc.shape == (n,)
        lens[i] += n
    all_slots = torch.cat([kv.req_pool.req_to_token[s, :n].long() for s, n in zip(slots, lens, strict=True)])
    assert (all_slots >= page).all(), "page 0 is the reserved sink"
    assert len(torch.unique(all_slots)) == len(all_slots), "two tokens share a KV slot"
    for s, n in zip(slots, lens, strict=True):  # a request's tokens fill its pages in order
        row = kv.req_pool.req_to_token[s, :n].long()
        assert torch.equal(row % page, torch.arange(n) % page)
        assert torch.equal(row // page, (row // page)[torch.arange(n) // page * page]) if n else True
    held = sum(-(-n // page) for n in lens)
    assert kv.allocator.available_pages() == 63 - held
    for s, n in zip(slots, lens, strict=True):
        kv.release(s, n)
    kv.check_all_free()


def test_warm_up_changes_no_state():
    """KVManager.warm_up (the start-up launch of the prefix cache's free and row-write ops) leaves the request rows,
    the free list and its count as they were, with requests holding pages."""
    kv = make(64, 4, layout=SlotLayout(group=FP8_SLOT_GROUP, heads=2))
    slots = [kv.req_pool.alloc() for _ in range(3)]
    for s, n in zip(slots, [5, 17, 9], strict=True):
        kv.extend(s, 0, n)
    table, free = kv.req_pool.req_to_token.clone(), kv.allocator.free_pages.clone()
    count = kv.allocator.available_pages()
    kv.warm_up()
    assert torch.equal(kv.req_pool.req_to_token, table)
    assert torch.equal(kv.allocator.free_pages, free) and kv.allocator.available_pages() == count


def test_alloc_refuses_without_taking():
    a = TokenToKVPoolAllocator(5 * 2, 2, "cpu")
    assert a.available_pages() == 4 and a.size == 8
    pages = a.alloc_pages(3)
    assert a.alloc_pages(2) is None and a.available_pages() == 1
    a.free_pages_(pages)
    assert a.available_pages() == 4


def test_leak_check_catches_a_held_page_and_slot():
    kv = make(8, 1)
    slot = kv.req_pool.alloc()
    kv.extend(slot, 0, 3)
    for deep in (False, True):  # the counts alone catch a held page
        with pytest.raises(RuntimeError, match="leak"):
            kv.check_all_free(deep)
    kv.release(slot, 3)
    kv.check_all_free()


def test_only_the_deep_leak_check_finds_a_page_free_twice():
    """A page freed twice and one lost balance the counts: the O(1) idle check passes, the deep one does not."""
    kv = make(8, 1)
    a = kv.allocator
    free = a.free_pages.clone()
    a.free_pages = torch.cat([free[:-1], free[:1]])  # the last page lost, the first listed twice
    kv.check_all_free(deep=False)
    with pytest.raises(RuntimeError, match="free list twice"):
        kv.check_all_free(deep=True)


def test_request_pool_exhaustion_and_double_free():
    pool = ReqToTokenPool(2, 16, "cpu")
    a, b = pool.alloc(), pool.alloc()
    assert pool.alloc() is None
    pool.free(a)
    with pytest.raises(AssertionError):
        pool.free(a)
    pool.free(b)


@pytest.mark.parametrize("slot_group", [None, 0, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_kv_pool_roundtrip(dtype, slot_group):
    pool = MHATokenToKVPool(32, dtype, head_num=2, head_dim=8, layer_num=3, device="cpu", slot_group=slot_group)
    if dtype == torch.float8_e4m3fn:
        assert pool.store_dtype == torch.uint8
    k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    loc = pool.layout.numbers(torch.tensor([3, 9, 4, 30, 17]))
    pool.set_kv_buffer(1, loc, k, v)
    kb, vb = pool.get_kv_buffer(1)
    assert kb.dtype == dtype
    torch.testing.assert_close(kb[loc].float(), k.to(dtype).float())
    torch.testing.assert_close(vb[loc].float(), v.to(dtype).float())
    group = pool.layout.group
    slots = -(-32 // group) * group if group else 32  # a grouped pool holds whole groups
    assert pool.bytes() == 2 * 3 * slots * 2 * 8 * (1 if dtype == torch.float8_e4m3fn else dtype.itemsize)
    # the rope + store op finds its layer by its K buffer
    assert [pool.layer_of(pool.get_store_buffer(i)[0]) for i in (2, 0, 1)] == [2, 0, 1]
    with pytest.raises(KeyError):
        pool.layer_of(pool.get_store_buffer(1)[1])  # a V buffer is no layer's K buffer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_kv_pool_layout(dtype):
    """fp8 buffers are head-major within groups of FP8_SLOT_GROUP slots, others token-major; either way indexed
    [slot number, head, dim]; `head_major` (whole-pool head-major or token-major) overrides the default."""
    fp8 = dtype == torch.float8_e4m3fn
    for head_major in (None, not fp8):
        pool = MHATokenToKVPool(32, dtype, head_num=2, head_dim=8, layer_num=1, device="cpu", head_major=head_major)
        group = FP8_SLOT_GROUP if fp8 and head_major is None else 0
        assert pool.layout == SlotLayout(group, 2)
        major = fp8 if head_major is None else head_major
        assert pool.head_major == major
        for buf in (*pool.get_kv_buffer(0), *pool.get_store_buffer(0)):
            assert buf.shape == ((group, 2, 8) if group else (32, 2, 8))
            assert buf.stride() == ((8, (group or 32) * 8, 1) if major else (16, 8, 1))


def test_slot_groups_memory_and_pages():
    """With slot groups of G, memory is [group, head, G slots, dim]: every slot's rows land there through the
    [slot number, head, dim] view, numbers and slots invert each other, and the allocator hands out pages whose
    slot numbers are one run, after the reserved first group."""
    G, H, D, size = 4, 3, 2, 12
    pool = MHATokenToKVPool(size, torch.float32, head_num=H, head_dim=D, layer_num=1, device="cpu", slot_group=G)
    layout = pool.layout
    real = torch.arange(size)
    numbers = layout.numbers(real)
    assert torch.equal(layout.slots(numbers), real)
    assert torch.equal(numbers, torch.tensor([0, 1, 2, 3, 12, 13, 14, 15, 24, 25, 26, 27]))
    assert layout.rows(size) == 28 and pool.get_kv_buffer(0)[0].shape == (28, H, D)
    k, v = torch.randn(size, H, D), torch.randn(size, H, D)
    pool.set_kv_buffer(0, numbers[torch.randperm(size)].sort().values, k, v)
    mem = torch.empty(0).set_(pool.get_store_buffer(0)[0].untyped_storage()).view(size // G, H, G, D)
    torch.testing.assert_close(mem, k.view(size // G, G, H, D).transpose(1, 2), rtol=0, atol=0)
    torch.testing.assert_close(pool.read_kv(0, numbers, torch.float32)[1], v, rtol=0, atol=0)

    a = TokenToKVPoolAllocator(4 * G, 2, "cpu", layout)
    assert a.reserved_pages == 2 and a.size == 3 * G and a.available_pages() == a.usable_pages == 6
    pages = a.alloc_pages(6)
    assert sorted(pages.tolist()) == [2, 3, 4, 5, 6, 7]  # the first group (pages 0, 1) is the sink's
    first = a.page_slots(pages)
    assert torch.equal(a.pages_of(first), pages) and torch.equal(a.pages_of(first + 1), pages)
    slots = layout.slots(first[:, None] + torch.arange(2))  # a page's numbers are one run of the pool's slots
    assert torch.equal(slots, pages[:, None] * 2 + torch.arange(2))
    with pytest.raises(ValueError, match="must divide the KV pool's slot group"):
        TokenToKVPoolAllocator(32, 8, "cpu", layout)


@pytest.mark.parametrize("page", [1, 4])
def test_batched_decode_extend_equals_per_request_extend(page):
    gen = torch.Generator().manual_seed(page)
    lens = [int(n) for n in torch.randint(1, 40, (6,), generator=gen)]
    lens[0] = 4 * page  # a request exactly at a page boundary opens a new page
    results = []
    for batched in (False, True):
        kv = make(200, page)
        slots = [kv.req_pool.alloc() for _ in lens]
        for s, n in zip(slots, lens, strict=True):
            kv.extend(s, 0, n)
        for step in range(9):
            cur = [n + step for n in lens]
            if batched:
                loc = kv.extend_decode(slots, cur)
                record_slots(kv, slots, cur, loc)
            else:
                loc = torch.cat([kv.extend(s, n, n + 1) for s, n in zip(slots, cur, strict=True)])
            assert loc.shape == (len(slots),)
        rows = torch.stack([kv.req_pool.req_to_token[s, : max(lens) + 9] for s in slots])
        results.append((rows, kv.allocator.available_pages()))
        for s, n in zip(slots, lens, strict=True):
            kv.release(s, n + 9)
        kv.check_all_free()
    (rows_a, free_a), (rows_b, free_b) = results
    assert free_a == free_b
    for r, n in enumerate(lens):  # same page structure (page ids may differ in order)
        a, b = rows_a[r, : n + 9].long(), rows_b[r, : n + 9].long()
        assert torch.equal(a % page, b % page) and torch.equal(a % page, torch.arange(n + 9) % page)
        assert len(torch.unique(b // page)) == -(-(n + 9) // page)


class PlainPages:
    """The paged pool as a plain Python model, token by token: a request's token at position i lives at offset
    i % page of its (i // page)-th page; a new page comes off the front of the free list; freed pages go to its
    back in the order freed; a slot's number is the layout's (SlotLayout: slot groups skip the other heads' runs).
    The oracle for KVManager's vectorized bookkeeping."""

    def __init__(self, num_pages: int, page: int, layout: SlotLayout) -> None:
        self.page, self.free, self.rows = page, list(range(max(1, layout.group // page), num_pages)), {}
        self.layout = layout

    def number(self, slot: int) -> int:
        g = self.layout.group
        return slot // g * g * self.layout.heads + slot % g if g else slot

    def extend(self, slot: int, cur: int, new: int) -> list[int]:
        pages = self.rows.setdefault(slot, [])
        if cur == 0:
            pages.clear()
        locs = []
        for i in range(cur, new):
            if i % self.page == 0:
                pages.append(self.free.pop(0))
            locs.append(self.number(pages[i // self.page] * self.page + i % self.page))
        return locs

    def release(self, slot: int) -> None:
        self.free += self.rows.pop(slot, [])


@pytest.mark.parametrize("group", [0, 16])
@pytest.mark.parametrize("page", [1, 4, 16])
def test_extend_batch_matches_a_plain_per_token_model(page, group):
    """Random batches of multi-token and one-token extends, partly filled pages, requests finishing and their
    pages coming back (the allocator merges returned pages lazily): every slot handed out, every req_to_token
    entry and every free count equal the plain model's, with slot numbers as they are and in slot groups."""
    gen = torch.Generator().manual_seed(100 + page)
    layout = SlotLayout(group, 3)
    kv, model = make(90, page, reqs=12, ctx=512, layout=layout), PlainPages(90, page, layout)
    lens: dict[int, int] = {}
    for _ in range(80):
        if len(lens) < 12 and torch.rand(1, generator=gen) < 0.5:
            lens[kv.req_pool.alloc()] = 0
        if lens and torch.rand(1, generator=gen) < 0.25:  # one finishes
            slot = list(lens)[int(torch.randint(len(lens), (1,), generator=gen))]
            kv.release(slot, lens.pop(slot))
            model.release(slot)
        batch = [s for s in lens if torch.rand(1, generator=gen) < 0.7]
        grow = [int(torch.randint(1, 3 * page + 2, (1,), generator=gen)) if torch.rand(1, generator=gen) < 0.5
                else 1 for _ in batch]
        cur = [lens[s] for s in batch]
        new = [c + g for c, g in zip(cur, grow, strict=True)]
        if sum(kv.pages_needed(c, n) for c, n in zip(cur, new, strict=True)) > kv.allocator.available_pages():
            assert kv.extend_batch(batch, cur, new) is None  # refused, nothing taken
            continue
        loc = kv.extend_batch(batch, cur, new)
        want = [x for s, c, n in zip(batch, cur, new, strict=True) for x in model.extend(s, c, n)]
        assert loc.tolist() == want
        for s, n in zip(batch, new, strict=True):
            lens[s] = n
        for s, n in lens.items():
            assert kv.req_pool.req_to_token[s, :n].tolist() == [
                model.number(model.rows[s][i // page] * page + i % page) for i in range(n)]
        assert kv.allocator.available_pages() == len(model.free)
    for s, n in lens.items():
        kv.release(s, n)
    kv.check_all_free()


def test_batched_decode_extend_refuses_without_taking():
    kv = make(4, 1)  # 3 usable pages
    slots = [kv.req_pool.alloc() for _ in range(2)]
    kv.extend(slots[0], 0, 1)
    kv.extend(slots[1], 0, 1)
    assert kv.extend_decode(slots, [1, 1]) is None
    assert kv.allocator.available_pages() == 1
    for s in slots:
        kv.release(s, 1)
    kv.check_all_free()
