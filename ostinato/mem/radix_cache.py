"""Prefix cache: a radix tree over the KV pool whose nodes own KV slots.

Each edge holds a run of key ids (a multiple of `page_size` long) and the KV slots of those tokens. A path
from the root spells a cached prefix; its slots, concatenated, are that prefix's K/V. Requests share the
slots by pointing their `req_to_token` rows at them (no copy). A node locked by a running request (its
`lock_ref` > 0, counted on every node up to the root) is never evicted; unlocked leaves are evicted in LRU
order, their pages going back to the allocator.

Keys are ints, usually token ids. A caller whose tokens do not identify their K/V alone (an image's
placeholder tokens, say) passes other ids at those positions (e.g. ids derived from the image's content
hash); the tree only compares them.
"""

import heapq
import itertools
from collections.abc import Sequence

import torch

from ostinato.mem.token_allocator import TokenToKVPoolAllocator


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access")

    def __init__(self, parent: "TreeNode | None" = None, key: list[int] | None = None,
                 value: torch.Tensor | None = None) -> None:
        self.children: dict = {}  # first page of the child's key (a tuple; the id itself at page_size 1) -> child
        self.parent = parent
        self.key: list[int] = key if key is not None else []
        self.value = value  # int64 slots, one per key id
        self.lock_ref = 0
        self.last_access = 0


class RadixCache:
    def __init__(self, allocator: TokenToKVPoolAllocator) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.root = TreeNode(key=[], value=torch.empty(0, dtype=torch.int64, device=allocator.device))
        self.root.lock_ref = 1  # never evicted
        self.evictable_size = 0  # tokens in unlocked nodes
        self.protected_size = 0  # tokens in locked nodes
        self._clock = itertools.count(1)  # LRU time: a counter, so runs are reproducible
        self._tie = itertools.count()
        self.num_evicted = 0  # tokens evicted so far

    # ------------------------------------------------------------------ helpers
    def _first(self, key: Sequence[int], i: int = 0):
        return key[i] if self.page_size == 1 else tuple(key[i : i + self.page_size])

    def aligned(self, n: int) -> int:
        return n - n % self.page_size

    def _common_len(self, a: Sequence[int], b: Sequence[int]) -> int:
        """Length of the common prefix of a and b, in whole pages."""
        n = min(len(a), len(b))
        if a[:n] == b[:n]:  # the common case, compared in C
            return self.aligned(n)
        i = 0
        while a[i] == b[i]:
            i += 1
        return self.aligned(i)

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Cut child's edge after m ids; the new upper node (returned) takes child's place."""
        upper = TreeNode(child.parent, child.key[:m], child.value[:m])
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        child.parent.children[self._first(upper.key)] = upper
        child.key, child.value, child.parent = child.key[m:], child.value[m:], upper
        upper.children[self._first(child.key)] = child
        return upper

    # ------------------------------------------------------------------ match / insert
    def match_prefix(self, key: Sequence[int]) -> tuple[torch.Tensor, TreeNode]:
        """Slots of the longest cached prefix of `key` (whole pages), and the node where it ends."""
        values, node = self.match_values(key)
        if not values:
            return self.root.value, node
        return (values[0] if len(values) == 1 else torch.cat(values)), node

    def match_values(self, key: Sequence[int]) -> tuple[list[torch.Tensor], TreeNode]:
        """`match_prefix` with the slots left as the matched edges' values, in order (no device op)."""
        key = list(key[: self.aligned(len(key))])
        now = next(self._clock)
        node, values, i = self.root, [], 0
        while i < len(key):
            child = node.children.get(self._first(key, i))
            if child is None:
                break
            child.last_access = now
            m = self._common_len(child.key, key[i:])
            if m < len(child.key):
                child = self._split(child, m)
            values.append(child.value)
            node, i = child, i + m
        return values, node

    def insert(self, key: Sequence[int], value: torch.Tensor) -> int:
        """Cache `value` (slots) for `key` (both cut to whole pages). Returns how many leading ids were
        already cached: the tree keeps its own slots for those, and the caller still owns (and must free)
        value[:returned]; the tree owns the rest of the (cut) value from now on."""
        n = self.aligned(len(key))
        key, value = list(key[:n]), value[:n]
        now = next(self._clock)
        node, i = self.root, 0
        while i < n:
            child = node.children.get(self._first(key, i))
            if child is None:
                new = TreeNode(node, key[i:], value[i:].to(torch.int64))
                new.last_access = now
                node.children[self._first(new.key)] = new
                self.evictable_size += n - i
                return i
            child.last_access = now
            m = self._common_len(child.key, key[i:])
            if m < len(child.key):
                child = self._split(child, m)
            node, i = child, i + m
        return n

    # ------------------------------------------------------------------ locks
    def lock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, "unlock of an unlocked node"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node = node.parent

    # ------------------------------------------------------------------ eviction
    def nodes(self) -> list[TreeNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots (fewer if not that many are evictable), least recently used
        unlocked leaves first. Returns the number freed."""
        if num_tokens <= 0:
            return 0
        heap = [(n.last_access, next(self._tie), n) for n in self.nodes()
                if not n.children and n.lock_ref == 0 and n is not self.root]
        heapq.heapify(heap)
        freed, pages = 0, []
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            pages.append(self.allocator.pages_of(leaf.value[:: self.page_size]))
            freed += len(leaf.key)
            parent = leaf.parent
            del parent.children[self._first(leaf.key)]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, next(self._tie), parent))
        if pages:
            self.allocator.free_pages_(torch.cat(pages))
        self.evictable_size -= freed
        self.num_evicted += freed
        return freed

    # ------------------------------------------------------------------ checks
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    def all_slots(self) -> torch.Tensor:
        vals = [n.value for n in self.nodes() if n is not self.root]
        return torch.cat(vals) if vals else self.root.value

    def check(self) -> None:
        """Raise AssertionError if a structural invariant is broken (tests and the idle leak check)."""
        evictable = protected = 0
        for node in self.nodes():
            if node is self.root:
                continue
            n = len(node.key)
            assert n > 0 and n % self.page_size == 0 and n == len(node.value), "edge length"
            assert node.parent.children.get(self._first(node.key)) is node, "child keyed by its first page"
            assert node.lock_ref >= 0 and all(c.lock_ref <= node.lock_ref for c in node.children.values()), \
                "a node is locked less than its children"
            if node.lock_ref:
                protected += n
            else:
                evictable += n
        assert (evictable, protected) == (self.evictable_size, self.protected_size), "size counters"
