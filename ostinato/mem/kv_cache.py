"""Layer 3 of the memory pool: the physical K/V buffers."""

import abc

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class KVCache(abc.ABC):
    """Per-layer key/value storage indexed by token slot.

    fp8 caches are stored as uint8 because index_put is not implemented for the fp8 dtypes; `dtype`
    is what attention sees, `store_dtype` what the buffers hold.
    """

    def __init__(self, size: int, dtype: torch.dtype, layer_num: int, device: torch.device | str) -> None:
        self.size = size
        self.dtype = dtype
        self.store_dtype = torch.uint8 if dtype in FP8_DTYPES else dtype
        self.layer_num = layer_num
        self.device = device

    @abc.abstractmethod
    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    @abc.abstractmethod
    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def bytes(self) -> int: ...


class MHATokenToKVPool(KVCache):
    """K and V buffers of shape [size, kv_heads, head_dim] for every layer."""

    def __init__(
        self,
        size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: torch.device | str,
    ) -> None:
        super().__init__(size, dtype, layer_num, device)
        self.head_num = head_num
        self.head_dim = head_dim
        shape = (size, head_num, head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=self.store_dtype, device=device) for _ in range(layer_num)]
        self.v_buffer = [torch.zeros(shape, dtype=self.store_dtype, device=device) for _ in range(layer_num)]

    def _view(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(self.dtype) if self.store_dtype != self.dtype else t

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._view(self.k_buffer[layer_id]), self._view(self.v_buffer[layer_id])

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.store_dtype != self.dtype:
            k = k.to(self.dtype).view(self.store_dtype)
            v = v.to(self.dtype).view(self.store_dtype)
        else:
            k, v = k.to(self.dtype), v.to(self.dtype)
        self.k_buffer[layer_id][loc] = k
        self.v_buffer[layer_id][loc] = v

    def bytes(self) -> int:
        per = self.k_buffer[0].numel() * self.k_buffer[0].element_size()
        return 2 * per * self.layer_num

    @staticmethod
    def bytes_per_token(head_num: int, head_dim: int, layer_num: int, dtype: torch.dtype) -> int:
        itemsize = 1 if dtype in FP8_DTYPES else torch.empty((), dtype=dtype).element_size()
        return 2 * head_num * head_dim * layer_num * itemsize
