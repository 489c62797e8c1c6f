"""The L3 store interface: put, get, exists and remove of one rank's CPU blocks, by key.

A store serves one rank of one process. `attach` hands it the rank's CPU tier once (Mooncake registers
it, so puts and gets read and write the CPU blocks in place); every call then names CPU blocks by id. An
object is a block's bytes followed by its header (keys), which a put writes into the slot after the
block and a get fetches into it, so the whole object is one buffer of the tier.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from ..errors import TransferError
from .keys import HEADER_BYTES, ObjectKeys


class StoreError(TransferError):
    """The store could not be used (unreachable, failed I/O); the message names the store."""


# begins the error of a fetch that found objects missing or not matching: the store itself worked
MISS = "L3 miss"


class BlockStore(ABC):
    url: str
    blocks = tier = headers = None      # the attached CPU tier (see attach)
    sealer = None                       # seal.Sealer when the URL names a deployment key (key_file)

    def attach(self, blocks: np.ndarray, block_bytes: int):
        """The rank's CPU tier, uint8 [num_cpu_blocks, cpu_block_stride]: each row a block of `block_bytes`,
        then its slot, where put and get lay the object's header (see keys). `tier` views the blocks' bytes."""
        if blocks.ndim != 2 or blocks.dtype != np.uint8 or blocks.shape[1] < block_bytes + HEADER_BYTES \
                or not blocks.flags.c_contiguous:
            raise ValueError(f"a CPU tier is a C-contiguous uint8 [blocks, stride] array with room for a "
                             f"{HEADER_BYTES}-byte header after each block of {block_bytes} bytes")
        self.blocks, self.tier = blocks, blocks[:, :block_bytes]
        self.headers = blocks[:, block_bytes:block_bytes + HEADER_BYTES]

    def detach(self):
        """Forget the CPU tier (before its memory is unmapped)."""
        self.blocks = self.tier = self.headers = None

    @abstractmethod
    def put(self, keys: ObjectKeys, hashes: np.ndarray, cpu_ids: np.ndarray) -> int:
        """Store CPU block cpu_ids[i] as the object of hashes[i]. An object becomes visible whole or not at
        all. Returns how many were not stored because the store is full right now (a cache's normal state:
        those are later misses, not errors). Raises StoreError when the store itself fails."""

    @abstractmethod
    def get(self, keys: ObjectKeys, hashes: np.ndarray, cpu_ids: np.ndarray, foreign: np.ndarray | None = None
            ) -> np.ndarray:
        """Fetch the object of hashes[i] into CPU block cpu_ids[i]; returns a bool hit per hash. A missing
        object, or one whose header or checksum does not match, is a miss, and that CPU block's bytes are
        then undefined. An object this engine cannot authenticate (keys.FOREIGN: another key's) is a miss
        left in the store, and marked True in `foreign` (a bool per hash) when given; a corrupt one is
        removed. Raises StoreError when the store itself fails."""

    @abstractmethod
    def exists(self, keys: ObjectKeys, hashes: np.ndarray) -> np.ndarray:
        """A bool per hash: is its object there (not fetched, so not yet checked)?"""

    def exists_every_rank(self, keys: list[ObjectKeys], hashes: np.ndarray) -> np.ndarray:
        """A bool per hash: is its object there for every one of these ranks' keys?"""
        present = np.ones(len(hashes), bool)
        for rank_keys in keys:
            present &= self.exists(rank_keys, hashes)
        return present

    @abstractmethod
    def remove(self, keys: ObjectKeys, hashes: np.ndarray):
        """Remove the objects of these hashes (absent ones are ignored)."""

    def close(self):
        pass

    def __repr__(self):
        return f"{type(self).__name__}({self.url!r})"
