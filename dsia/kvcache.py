"""Static, preallocated, position-indexed KV cache for one sequence.

Slots [0, length) hold the committed prefix (always written by the target). Slots [length, capacity) are
scratch: draft and verification forwards write their tokens there. Committing an accepted path gathers its
scratch slots into the next committed slots; rollback moves the length. Nothing is allocated per step.
`spare` slots past the capacity take the writes of padding rows (a CUDA graph run over more rows than tokens).
"""
from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", spare: int = 0) -> None:
        shape = (n_layers, n_kv_heads, capacity + spare, head_dim)
        # allocated once, zeroed lazily: slots up to `zeroed` hold finite values (a masked-out slot still enters
        # the attention matmul, and 0 * NaN would poison it); untouched pages cost no memory
        self.k = torch.empty(shape, dtype=dtype, device=device)  # [layers, kv_heads, capacity + spare, head_dim]
        self.v = torch.empty(shape, dtype=dtype, device=device)  # [layers, kv_heads, capacity + spare, head_dim]
        self.capacity = capacity  # slots tokens can use
        self.spare = spare  # slots [capacity, capacity + spare): padding rows write there, nothing reads them
        self.length = 0  # committed tokens
        self.changes = 0  # commits and rollbacks so far: whoever noted it knows whether the prefix changed since
        self.zeroed = 0  # slots [0, zeroed) have been initialised

    def reserve(self, end: int) -> None:
        """Make slots [0, end) safe to read (called before a forward that touches them; spare slots included)."""
        if end > self.zeroed:
            end = min(self.capacity + self.spare, max(end, self.zeroed + 256))  # grow in chunks, not per token
            self.k[:, :, self.zeroed:end].zero_()
            self.v[:, :, self.zeroed:end].zero_()
            self.zeroed = end

    def zero_all(self) -> None:
        """Initialise every slot, spare ones included (before attention over all slots, as a CUDA graph runs)."""
        self.k.zero_()
        self.v.zero_()
        self.zeroed = self.capacity + self.spare

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def load(self, k: Tensor, v: Tensor) -> None:
        """Make k, v [layers, kv_heads, n, head_dim] the committed prefix (KV an earlier forward computed)."""
        n = k.shape[2]
        assert n <= self.capacity and k.shape == v.shape == (*self.k.shape[:2], n, self.k.shape[3]), k.shape
        self.k[:, :, :n] = k
        self.v[:, :, :n] = v
        self.zeroed = max(self.zeroed, n)
        self.length = n
        self.changes += 1

    def write(self, layer: int, start: int, k: Tensor, v: Tensor) -> None:
        """Write k, v [kv_heads, T, head_dim] into slots [start, start + T); never below the committed length."""
        end = start + k.shape[1]
        assert self.length <= start and end <= self.capacity, (start, end, self.length, self.capacity)
        self.k[layer, :, start:end] = k
        self.v[layer, :, start:end] = v

    def write_slots(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Write k, v [kv_heads, T, head_dim] into the slots given as a tensor [T] (no host sync: capturable)."""
        self.k[layer].index_copy_(1, slots, k)
        self.v[layer].index_copy_(1, slots, v)

    def read(self, layer: int, end: int) -> tuple[Tensor, Tensor]:
        """Views of slots [0, end): ([kv_heads, end, head_dim], [kv_heads, end, head_dim])."""
        return self.k[layer, :, :end], self.v[layer, :, :end]

    def commit(self, scratch_slots: list[int]) -> None:
        """Append the given scratch slots (offsets from `length`, increasing) to the committed prefix."""
        n = len(scratch_slots)
        if n == 0:
            return
        assert all(b > a for a, b in zip(scratch_slots, scratch_slots[1:])), "slots must increase"
        assert self.length + scratch_slots[-1] < self.capacity
        if scratch_slots != list(range(n)):  # a chain needs no copy; a tree path is gathered
            src = torch.tensor(scratch_slots, device=self.k.device) + self.length
            self.k[:, :, self.length:self.length + n] = self.k.index_select(2, src)
            self.v[:, :, self.length:self.length + n] = self.v.index_select(2, src)
        self.length += n
        self.changes += 1

    def rollback(self, length: int) -> None:
        """Forget everything from slot `length` on."""
        assert 0 <= length <= self.length
        self.length = length
        self.changes += 1
