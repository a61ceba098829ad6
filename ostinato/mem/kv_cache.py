"""Layer 3 of the memory pool: the physical K/V buffers."""

import abc
import os
from dataclasses import dataclass

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# fp8 caches are laid out head-major within groups of this many slots (SlotLayout); page sizes must divide it.
# OSTINATO_FP8_SLOT_GROUP=0: whole-pool head-major buffers (the layout before groups, for comparisons)
FP8_SLOT_GROUP = int(os.environ.get("OSTINATO_FP8_SLOT_GROUP", "128"))
if FP8_SLOT_GROUP < 0 or FP8_SLOT_GROUP & (FP8_SLOT_GROUP - 1):
    raise ValueError(f"OSTINATO_FP8_SLOT_GROUP must be 0 or a power of two, got {FP8_SLOT_GROUP}")


def slot_group_for(dtype: torch.dtype, page_size: int) -> int:
    """The pool's slot group (SlotLayout) for a cache dtype and page size: FP8_SLOT_GROUP for fp8 where the page
    size divides it, else 0 (fp8 then head-major, as MHATokenToKVPool defaults)."""
    return FP8_SLOT_GROUP if dtype in FP8_DTYPES and FP8_SLOT_GROUP and FP8_SLOT_GROUP % page_size == 0 else 0


@dataclass(frozen=True)
class SlotLayout:
    """How slot numbers (what req_to_token holds and every kernel indexes with) map onto a pool's memory.

    group 0: slot numbers are the pool's slots as they are, and a buffer is [slot, head, dim] in memory
    (token-major) or [head, slot, dim] (head-major).
    group G > 0 (G a multiple of the page size): memory is [slot group, head, G slots, dim]. Each head's G slots
    are one run, as head-major gives, and a group's heads sit side by side, as token-major gives: the split-KV
    decode kernel then reads a request's contiguous slots as runs of whole lines, with the programs of its
    heads (launched together) reading neighbouring runs. The kernels index [slot, head, dim] with two strides
    (dim, G x dim), which holds when slot numbers skip the other heads' runs: the pool's slot s (page p's are p x
    page_size ..) is numbered (s // G) x G x heads + s % G. Numbers in the skipped ranges are never handed out.
    """

    group: int = 0
    heads: int = 1

    # s + (s // G) x G x (heads - 1) = (s // G) x G x heads + s % G, without the remainder (a decode step maps its
    # new slots: one op fewer a step)
    def numbers(self, slots: torch.Tensor | int) -> torch.Tensor | int:
        """The pool's slots -> their slot numbers."""
        if not self.group:
            return slots
        return slots + slots // self.group * (self.group * (self.heads - 1))

    def slots(self, numbers: torch.Tensor | int) -> torch.Tensor | int:
        """Slot numbers -> the pool's slots (the inverse of `numbers`)."""
        if not self.group:
            return numbers
        return numbers - numbers // (self.group * self.heads) * (self.group * (self.heads - 1))

    def rows(self, size: int) -> int:
        """Slot numbers a buffer view of a pool of `size` slots spans (up to the last slot's number)."""
        return self.numbers(size - 1) + 1 if size else 0


def fp8_max(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max


class KVCache(abc.ABC):
    """Per-layer key/value storage indexed by token slot.

    fp8 caches are stored as uint8 because index_put is not implemented for the fp8 dtypes; `dtype`
    is what attention sees, `store_dtype` what the buffers hold. An fp8 cache holds x / scale (saturated
    to the fp8 range) and is read as stored * scale, with one K scale and one V scale per layer (from the
    checkpoint, else 1.0). The scales live on the device (`k_scale(layer)` / `v_scale(layer)`: 1-element
    float32 views, each 16-byte aligned), so kernels read them inside a captured graph with no host sync.
    """

    def __init__(self, size: int, dtype: torch.dtype, layer_num: int, device: torch.device | str) -> None:
        self.size = size
        self.dtype = dtype
        self.store_dtype = torch.uint8 if dtype in FP8_DTYPES else dtype
        self.layer_num = layer_num
        self.device = device
        self.is_fp8 = dtype in FP8_DTYPES
        # [layer, {k, v}, pad to 16 bytes]: one kernel specialization for every layer's scale pointer
        self.scales = torch.ones(layer_num, 2, 2, dtype=torch.float32, device=device)
        self.scales_host: list[tuple[float, float]] = [(1.0, 1.0)] * layer_num

    def set_scales(self, scales: dict[int, tuple[float, float]]) -> None:
        """Per-layer (k_scale, v_scale); layers not given keep 1.0. Set before any K/V is stored."""
        for layer, (ks, vs) in scales.items():
            if not (0 <= layer < self.layer_num):
                raise ValueError(f"kv scales: layer {layer} out of range (the model has {self.layer_num})")
            if not (ks > 0 and vs > 0):
                raise ValueError(f"kv scales of layer {layer} must be > 0, got k {ks}, v {vs}")
            self.scales_host[layer] = (float(ks), float(vs))
        self.scales.copy_(torch.tensor([[[k, 0.0], [v, 0.0]] for k, v in self.scales_host]))

    def k_scale(self, layer_id: int) -> torch.Tensor:
        return self.scales[layer_id, 0, :1]

    def v_scale(self, layer_id: int) -> torch.Tensor:
        return self.scales[layer_id, 1, :1]

    @abc.abstractmethod
    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    @abc.abstractmethod
    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def layer_of(self, k_store_buffer: torch.Tensor) -> int:
        """The layer of a K buffer, by identity: the rope + store op takes the buffer, not the layer id."""

    @abc.abstractmethod
    def bytes(self) -> int: ...


class MHATokenToKVPool(KVCache):
    """K and V buffers indexed [slot, kv_head, head_dim] for every layer.

    In memory a buffer is token-major (a slot's heads side by side), with `head_major` head-major (each
    head's slots side by side: a [kv_heads, size, head_dim] tensor seen through a permuted view, so every
    reader indexes it the same way and the kernels take its strides), or with `slot_group` G head-major within
    groups of G slots (`SlotLayout`; a strided view of [size / G, kv_heads, G, head_dim]). Head-major rows are
    what fp8 caches want: a head's row of a slot is 64 bytes at head dim 64, and the split-KV decode kernel reads
    a request's contiguous slots as one run per head instead of 64-byte pieces 512 bytes apart. H200,
    Llama-3.2-1B, ms a step token-major -> head-major, two runs each (docs/gpu-notes.md):
    - fp8: bs 128 x 4096 3.918 -> 3.708, bs 256 x 1024 2.746 -> 2.716, bs 32 x 4096 1.705 -> 1.694;
    - bf16 (128-byte rows): 1% slower at those shapes, so it stays token-major.
    fp8 caches default to groups of FP8_SLOT_GROUP slots; slot numbers then come from `layout`.
    """

    def __init__(
        self,
        size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: torch.device | str,
        head_major: bool | None = None,
        slot_group: int | None = None,
    ) -> None:
        super().__init__(size, dtype, layer_num, device)
        self.head_num = head_num
        self.head_dim = head_dim
        group = slot_group_for(dtype, 1) if head_major is None and slot_group is None else (slot_group or 0)
        self.layout = SlotLayout(group, head_num)
        self.head_major = bool(group) or (self.is_fp8 if head_major is None else head_major)
        self.alt_stream: torch.cuda.Stream | None = None  # see set_kv_buffer

        def buffer() -> torch.Tensor:
            if group:  # [groups, heads, G, dim] seen as [slot number, head, dim] (SlotLayout)
                groups = -(-size // group)
                flat = torch.zeros(groups * head_num * group * head_dim, dtype=self.store_dtype, device=device)
                return flat.as_strided((self.layout.rows(groups * group), head_num, head_dim),
                                       (head_dim, group * head_dim, 1))
            if self.head_major:
                return torch.zeros(head_num, size, head_dim, dtype=self.store_dtype, device=device).permute(1, 0, 2)
            return torch.zeros(size, head_num, head_dim, dtype=self.store_dtype, device=device)

        self.k_buffer = [buffer() for _ in range(layer_num)]
        self.v_buffer = [buffer() for _ in range(layer_num)]
        self._layer_by_ptr = {buf.data_ptr(): i for i, buf in enumerate(self.k_buffer)}

    def _view(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(self.dtype) if self.store_dtype != self.dtype else t

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The buffers in `dtype` (an fp8 view of the stored bytes, not dequantized)."""
        return self._view(self.k_buffer[layer_id]), self._view(self.v_buffer[layer_id])

    def get_store_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The buffers as stored (uint8 for fp8): what the Triton kernels read and write."""
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def layer_of(self, k_store_buffer: torch.Tensor) -> int:
        """The layer whose K buffer (as `get_store_buffer` gives it) this is."""
        return self._layer_by_ptr[k_store_buffer.data_ptr()]

    def quantize(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """x / scale, saturated to the fp8 range and rounded to nearest even, as the stored bytes."""
        m = fp8_max(self.dtype)
        return (x.float() / scale).clamp_(-m, m).to(self.dtype).view(self.store_dtype)

    def read_kv(self, layer_id: int, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at `slots` in `dtype`, dequantized (the torch backend's gather)."""
        k_buf, v_buf = self.get_kv_buffer(layer_id)
        k, v = k_buf[slots], v_buf[slots]
        if not self.is_fp8:
            return k.to(dtype), v.to(dtype)
        return ((k.to(torch.float32) * self.k_scale(layer_id)).to(dtype),
                (v.to(torch.float32) * self.v_scale(layer_id)).to(dtype))

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Indexed writes of K and V (quantized for fp8). While a CUDA graph is captured and `alt_stream` is
        set, V is written on that stream beside K and joined back before returning (seed 001), so the
        graph holds the two writes as parallel branches."""
        alt = self.alt_stream
        if alt is not None and torch.cuda.is_current_stream_capturing():
            cur = torch.cuda.current_stream()
            alt.wait_stream(cur)
            self._write(self.k_buffer[layer_id], loc, k, self.k_scale(layer_id))
            with torch.cuda.stream(alt):
                self._write(self.v_buffer[layer_id], loc, v, self.v_scale(layer_id))
            cur.wait_stream(alt)
            return
        self._write(self.k_buffer[layer_id], loc, k, self.k_scale(layer_id))
        self._write(self.v_buffer[layer_id], loc, v, self.v_scale(layer_id))

    def _write(self, buf: torch.Tensor, loc: torch.Tensor, x: torch.Tensor, scale: torch.Tensor) -> None:
        buf[loc] = self.quantize(x, scale) if self.is_fp8 else x.to(self.dtype)

    def bytes(self) -> int:
        per = self.k_buffer[0].untyped_storage().nbytes()  # a grouped view spans more numbers than it holds
        return 2 * per * self.layer_num

    @staticmethod
    def bytes_per_token(head_num: int, head_dim: int, layer_num: int, dtype: torch.dtype) -> int:
        itemsize = 1 if dtype in FP8_DTYPES else torch.empty((), dtype=dtype).element_size()
        return 2 * head_num * head_dim * layer_num * itemsize
