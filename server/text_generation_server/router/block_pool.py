"""The router's KV blocks: allocation, and the prefix cache over them.

The router is the single owner of KV blocks (TGI v3): every shard lays its cache out the same
way and writes only where a request's blocks say. Block 0 is reserved (TGI's health checks).

Prefix caching: a block whose tokens are all computed is content-addressed by a chained hash
(its tokens and its prefix's hash), so equal prefixes map to equal blocks whatever came after
them. Blocks are reference-counted; when the last request holding a cached block ends, the
block stays cached (evictable, least recently used first) until memory is needed. A new
request reuses the longest run of whole cached blocks at the start of its prompt, always
leaving at least the prompt's last token to compute (the first new token needs its logits),
so a shared block is only ever read, never written. An evicted block loses its hash before it
is handed out again, so nothing can find (and read) it through the cache afterwards.

The K/V of a prompt depend on the weights that computed them: a request with a LoRA adapter
seeds its chain with the adapter's key (`salt`, router/adapters.py) where the base model's
starts from nothing, so equal prompts under different adapters (or an adapter and the base)
never share a block.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field


@dataclass
class Allocation:
    """One request's blocks (prefix blocks from the cache first) and what the cache knows of them."""

    blocks: list[int]
    slots: list[int]
    cache_len: int = 0  # prompt tokens whose K/V the reused blocks already hold
    # Chained content hashes of this request's leading blocks whose tokens are all computed
    # (reused from the cache, or registered since; a duplicate of a cached block keeps its hash
    # here but stays private).
    hashes: list[int] = field(default_factory=list)
    salt: int | None = None  # what its chain starts from: the adapter's key, None for the base model


class BlockPool:
    """Free blocks, referenced blocks, and (with prefix caching) cached blocks no one holds."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False):
        if num_blocks < 2 or block_size < 1:
            raise ValueError(f"a block pool needs >= 2 blocks of >= 1 token (got {num_blocks} x {block_size})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free: deque[int] = deque(range(1, num_blocks))  # never cached or evicted, ready at once
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, int] = {}  # block -> chained hash
        self._tokens_of: dict[int, tuple[int, ...]] = {}  # block -> its tokens (hash collisions are checked)
        self._parent_of: dict[int, int | None] = {}  # block -> its prefix's hash
        self._block_of: dict[int, int] = {}  # chained hash -> block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self.evictions = 0  # blocks taken from the cache for new allocations (a counter)

    # -- sizes -----------------------------------------------------------------------------
    @property
    def free(self) -> int:
        """Blocks an allocation can take now (free, or cached but held by no request)."""
        return len(self._free) + len(self._evictable)

    @property
    def used(self) -> int:
        """Blocks held by requests."""
        return self.num_blocks - 1 - self.free

    @property
    def cached(self) -> int:
        """Blocks holding a cached prefix (held by requests or not)."""
        return len(self._block_of)

    def blocks_for(self, tokens: int) -> int:
        return (tokens + self.block_size - 1) // self.block_size

    # -- hashing ---------------------------------------------------------------------------
    @staticmethod
    def _root(salt: int | None) -> int | None:
        """The parent hash of a chain's first block: None for the base model, the adapter's own
        value otherwise (a tuple tagged so no block's hash can equal it)."""
        return None if salt is None else hash(("adapter", salt))

    def prefix_hashes(self, token_ids: list[int], full_blocks: int | None = None,
                      salt: int | None = None) -> list[int]:
        """Chained hashes of the leading whole blocks of `token_ids` (under the adapter `salt`)."""
        bs = self.block_size
        count = len(token_ids) // bs if full_blocks is None else min(full_blocks, len(token_ids) // bs)
        hashes, parent = [], self._root(salt)
        for i in range(count):
            parent = hash((parent, tuple(token_ids[i * bs:(i + 1) * bs])))
            hashes.append(parent)
        return hashes

    def _lookup(self, token_ids: list[int], most: int, salt: int | None) -> tuple[list[int], list[int]]:
        """Blocks and hashes of the longest cached prefix of whole blocks (at most `most` blocks)."""
        bs = self.block_size
        blocks, hashes, parent = [], [], self._root(salt)
        for i in range(min(most, len(token_ids) // bs)):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            digest = hash((parent, tokens))
            block = self._block_of.get(digest)
            if block is None or self._tokens_of[block] != tokens or self._parent_of[block] != parent:
                break
            blocks.append(block)
            hashes.append(digest)
            parent = digest
        return blocks, hashes

    # -- allocation ------------------------------------------------------------------------
    def allocate(self, tokens: int, prompt_ids: list[int] | None = None, salt: int | None = None) -> Allocation | None:
        """Blocks for `tokens` tokens, reusing the cached prefix of `prompt_ids` when given (computed
        under the adapter `salt`, None: the base model). None when the pool cannot hold them now
        (nothing is taken then)."""
        count = self.blocks_for(tokens)
        reused: list[int] = []
        hashes: list[int] = []
        if self.prefix_caching and prompt_ids:
            # Leave the last prompt token to compute: its logits choose the first new token.
            reused, hashes = self._lookup(prompt_ids, (len(prompt_ids) - 1) // self.block_size, salt)
            reused, hashes = reused[:count], hashes[:count]
        fresh = count - len(reused)
        unheld = sum(1 for b in reused if self._refs[b] == 0)  # reused blocks now counted as evictable
        if fresh > self.free - unheld:
            return None
        for block in reused:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
        blocks = reused + [self._take() for _ in range(fresh)]
        bs = self.block_size
        slots = [b * bs + o for b in blocks for o in range(bs)][:tokens]
        return Allocation(blocks, slots, cache_len=len(reused) * bs, hashes=hashes, salt=salt)

    def _take(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)  # least recently used
            self._forget(block)
            self.evictions += 1
        self._refs[block] = 1
        return block

    def _forget(self, block: int) -> None:
        digest = self._hash_of.pop(block)
        del self._block_of[digest]
        del self._tokens_of[block]
        del self._parent_of[block]

    def register(self, allocation: Allocation, token_ids: list[int], computed: int) -> int:
        """Caches the blocks of `allocation` whose tokens (`token_ids`, the sequence so far) all
        have K/V computed (`computed` tokens from the start). Returns how many blocks it added.
        A block whose content another block already caches stays private (freed at release).

        `computed` counts only positions whose K/V came from the request's own accepted tokens:
        with speculation, slots past them hold the K/V of rejected guesses, so a block is cached
        only when every one of its positions lies below `computed`."""
        if not self.prefix_caching:
            return 0
        full = min(computed, len(token_ids)) // self.block_size
        known = len(allocation.hashes)
        if full <= known:
            return 0
        hashes = self.prefix_hashes(token_ids, full, allocation.salt)
        added = 0
        for i in range(known, full):
            block, digest = allocation.blocks[i], hashes[i]
            allocation.hashes.append(digest)
            if digest in self._block_of or block in self._hash_of:
                continue  # another block caches this content; later blocks chain from its hash alike
            self._hash_of[block] = digest
            self._block_of[digest] = block
            self._tokens_of[block] = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            self._parent_of[block] = hashes[i - 1] if i else self._root(allocation.salt)
            added += 1
        return added

    def release(self, allocation: Allocation) -> None:
        """The request no longer holds its blocks. Cached ones stay (evictable), the rest are free.
        The tail goes into the LRU order first, so a prefix outlives its continuations."""
        for block in reversed(allocation.blocks):
            self._refs[block] -= 1
            if self._refs[block] < 0:
                raise RuntimeError(f"block {block} released more often than it was allocated")
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        allocation.blocks = []
        allocation.slots = []

    def reference_count(self, block: int) -> int:
        return self._refs[block]

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of
