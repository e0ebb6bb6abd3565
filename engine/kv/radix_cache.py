"""RadixCache: a prefix tree over token ids whose values are KV pool slots (SGLang's rules,
one token per slot).

- Children are keyed by their first token; a match or insert that ends inside a node splits
  it, so every boundary the scheduler cares about is a node boundary.
- A lock on a node covers its whole path to the root. Tokens in locked nodes are "protected",
  the rest "evictable"; both counts are kept incrementally.
- evict frees unlocked leaves in LRU order; a parent that becomes an unlocked leaf joins the
  heap, so branches shrink from the tip and shared stems last longest.
- A namespace has a tree of its own: a LoRA adapter's id (None for the base model), or with
  SGLang's extra_key (a cache salt) the pair (adapter id, key). A prefix is never shared across
  namespaces; an unloaded adapter's trees are dropped, and a keyed tree emptied by eviction or a
  flush goes too (a salt per policy version would otherwise leave a root per version behind).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any

import torch

from engine.kv.allocator import TokenSlotAllocator
from engine.kv.base import MatchResult, PrefixCache
from engine.kv.pool import ReqToTokenPool

_node_ids = itertools.count()


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access_time", "id")

    def __init__(self, key: list[int] | None = None, value: torch.Tensor | None = None, parent: TreeNode | None = None):
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.key: list[int] = key if key is not None else []
        self.value = value if value is not None else torch.empty(0, dtype=torch.int64)
        self.lock_ref = 0
        self.last_access_time = 0
        self.id = next(_node_ids)  # heap tie-break, so nodes are never compared

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock={self.lock_ref}, t={self.last_access_time})"


def _common_len(node_key: list[int], key: list[int], start: int) -> int:
    n = min(len(node_key), len(key) - start)
    if node_key[:n] == key[start : start + n]:  # fast path: whole node matches
        return n
    i = 0
    while node_key[i] == key[start + i]:
        i += 1
    return i


class RadixCache(PrefixCache):
    def __init__(self, allocator: TokenSlotAllocator, req_to_token_pool: ReqToTokenPool | None):
        self.allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        self._clock = itertools.count(1)  # logical access time; LRU needs order, not seconds
        self._new_root()

    def _new_root(self) -> None:
        self.root = TreeNode()
        self.roots: dict[Any, TreeNode] = {None: self.root}  # namespace -> its tree
        self._evictable = 0
        self._protected = 0

    def _root_of(self, namespace: Any) -> TreeNode:
        if namespace not in self.roots:
            self.roots[namespace] = TreeNode()
        return self.roots[namespace]

    @staticmethod
    def _is_root(node: TreeNode) -> bool:
        return node.parent is None and not node.key

    # ---- match / insert ---------------------------------------------------------------------
    def _walk(self, key: list[int], namespace: Any = None) -> tuple[TreeNode, int, list[torch.Tensor]]:
        """Descend while tokens agree, splitting the last node at the match boundary."""
        now = next(self._clock)
        node, i, values = self._root_of(namespace), 0, []
        node.last_access_time = now
        while i < len(key) and key[i] in node.children:
            child = node.children[key[i]]
            n = _common_len(child.key, key, i)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access_time = now
            values.append(child.value)
            node, i = child, i + n
        return node, i, values

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut child after n tokens; the new upper node takes child's place and lock count."""
        upper = TreeNode(child.key[:n], child.value[:n], child.parent)
        upper.lock_ref = child.lock_ref
        upper.last_access_time = child.last_access_time
        child.parent.children[child.key[0]] = upper
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        upper.children[child.key[0]] = child
        return upper

    def match_prefix(self, key: list[int], namespace: Any = None) -> MatchResult:
        node, _, values = self._walk(key, namespace)
        indices = torch.cat(values) if values else torch.empty(0, dtype=torch.int64)
        return MatchResult(indices, node)

    def insert(self, key: list[int], value: torch.Tensor, namespace: Any = None) -> int:
        if value.numel() != len(key):
            raise ValueError(f"insert: {len(key)} tokens but {value.numel()} slots")
        node, matched, _ = self._walk(key, namespace)
        if matched < len(key):
            slots = value[matched:].to(device="cpu", dtype=torch.int64, copy=True)
            leaf = TreeNode(list(key[matched:]), slots, node)
            leaf.last_access_time = node.last_access_time
            node.children[key[matched]] = leaf
            self._evictable += len(leaf.key)
        return matched

    # ---- locks ------------------------------------------------------------------------------
    def inc_lock_ref(self, node: Any) -> int:
        """Lock node and its ancestors; returns tokens moved from evictable to protected."""
        self._check_attached(node)
        delta = 0
        while node is not None and not self._is_root(node):
            if node.lock_ref == 0:
                delta += len(node.key)
            node.lock_ref += 1
            node = node.parent
        self._evictable -= delta
        self._protected += delta
        return delta

    def dec_lock_ref(self, node: Any) -> int:
        """Unlock node and its ancestors; returns tokens moved from protected to evictable."""
        if node is None or self._is_root(node):
            return 0
        if node.lock_ref <= 0:  # ancestors hold >= node's count, so checking node suffices
            raise RuntimeError(f"dec_lock_ref on unlocked {node!r}")
        delta = 0
        while not self._is_root(node):
            node.lock_ref -= 1
            if node.lock_ref == 0:
                delta += len(node.key)
            node = node.parent
        self._evictable += delta
        self._protected -= delta
        return delta

    def _check_attached(self, node: TreeNode | None) -> None:
        n = node
        while n is not None and not self._is_root(n):
            n = n.parent
        if node is not None and n is None:
            raise RuntimeError(f"cannot lock {node!r}: it was evicted or flushed")

    # ---- eviction / flush -------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        if num_tokens <= 0:
            return 0
        heap = [(n.last_access_time, n.id, n) for n in self._nodes() if self._is_evictable_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            self.allocator.free(node.value)
            freed += len(node.key)
            self._evictable -= len(node.key)
            parent = node.parent
            del parent.children[node.key[0]]
            node.parent = None  # detached: locking it later is an error
            if self._is_evictable_leaf(parent):
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        self._drop_empty_keyed_roots()
        return freed

    def _drop_empty_keyed_roots(self) -> None:
        """Forget extra_key trees left empty (an adapter's own tree stays until it is unloaded)."""
        for namespace in [ns for ns, root in self.roots.items() if isinstance(ns, tuple) and not root.children]:
            del self.roots[namespace]

    def _is_evictable_leaf(self, node: TreeNode) -> bool:
        return not self._is_root(node) and not node.children and node.lock_ref == 0

    def reset(self) -> None:
        if self._protected:
            raise RuntimeError(
                f"cannot flush the radix cache: {self._protected} tokens are locked by running requests"
            )
        self._free_tree(list(self._nodes()))
        # keep the root objects: requests whose last_node is a root stay valid across a flush
        for root in self.roots.values():
            root.children = {}
        self._drop_empty_keyed_roots()
        self._evictable = self._protected = 0

    def drop_namespace(self, namespace: Any) -> int:
        """Free a namespace's whole tree, and its extra_key trees (an unloaded LoRA adapter's KV);
        returns the tokens freed. Nothing in them may be locked (the adapter has no request left)."""
        dropped = [ns for ns in self.roots if ns == namespace or (isinstance(ns, tuple) and ns[0] == namespace)]
        nodes = [n for ns in dropped for n in self._nodes([self.roots[ns]]) if not self._is_root(n)]
        if any(n.lock_ref for n in nodes):
            raise RuntimeError(f"cannot drop cache namespace {namespace!r}: running requests lock it")
        for ns in dropped:
            self.roots.pop(ns).children = {}
        freed = self._free_tree(nodes)
        self._evictable -= freed
        return freed

    def _free_tree(self, nodes: list[TreeNode]) -> int:
        values = [n.value for n in nodes if not self._is_root(n)]
        for n in nodes:
            n.parent = None
        if values:
            self.allocator.free(torch.cat(values))
        return sum(v.numel() for v in values)

    def _nodes(self, roots: Any = None):
        stack = list(self.roots.values() if roots is None else roots)
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # ---- sizes / checks ---------------------------------------------------------------------
    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    def check_invariants(self) -> None:
        evictable = protected = 0
        values = []
        for root in self.roots.values():
            assert root.parent is None and not root.key, "roots must be empty and parentless"
        for node in self._nodes():
            child_locks = 0
            for tok, child in node.children.items():
                assert child.parent is node, f"{child!r} parent pointer broken"
                assert child.key, f"empty non-root node {child!r}"
                assert child.key[0] == tok, f"{child!r} keyed by {tok} but starts with {child.key[0]}"
                assert child.value.numel() == len(child.key), f"{child!r} value/key length mismatch"
                assert child.lock_ref >= 0, f"{child!r} negative lock_ref"
                child_locks += child.lock_ref
                if child.lock_ref:
                    protected += len(child.key)
                else:
                    evictable += len(child.key)
                values.append(child.value)
            if not self._is_root(node):
                assert node.lock_ref >= child_locks, f"{node!r} holds fewer locks than its children"
        assert evictable == self._evictable, f"evictable {self._evictable} != recount {evictable}"
        assert protected == self._protected, f"protected {self._protected} != recount {protected}"
        if values:
            slots = torch.cat(values)
            assert torch.unique(slots).numel() == slots.numel(), "duplicate slots in the tree"
            assert int(slots.min()) >= 1, "padding slot 0 in the tree"

    # ---- request level ----------------------------------------------------------------------
    def _row(self, req: Any, n: int) -> torch.Tensor:
        return self.req_to_token_pool.req_to_token[req.req_pool_idx, :n].to("cpu", copy=True)

    def cache_unfinished_req(self, req: Any) -> None:
        """After a prefill chunk: put fill_ids into the tree and make the request's row and
        lock point at the tree's copy (its own duplicates are freed)."""
        tokens = req.fill_ids
        kv = self._row(req, len(tokens))
        owned = len(req.prefix_indices)
        namespace = getattr(req, "cache_namespace", None)
        n = self.insert(tokens, kv, namespace)
        self.allocator.free(kv[owned:n])
        new_indices, new_node = self.match_prefix(tokens, namespace)
        self.req_to_token_pool.write(req.req_pool_idx, owned, new_indices[owned:])
        self.inc_lock_ref(new_node)
        self.dec_lock_ref(req.last_node)
        req.prefix_indices = new_indices
        req.last_node = new_node

    def cache_finished_req(self, req: Any) -> None:
        """On finish: prompt + output (less the last token, never fed back) join the tree, the
        lock is released and the row freed. The request owns nothing afterwards."""
        if req.req_pool_idx is not None:
            tokens = req.origin_input_ids + req.output_ids
            committed = req.kv_committed_len
            seq = max(min(len(tokens) - 1, committed), 0)
            kv = self._row(req, committed)
            owned = len(req.prefix_indices)
            n = self.insert(tokens[:seq], kv[:seq], getattr(req, "cache_namespace", None))
            self.allocator.free(kv[owned:n])
            # KV written past the last keyable token has no token id to key it by
            self.allocator.free(kv[max(seq, owned) : committed])
            self.req_to_token_pool.free(req.req_pool_idx)
            req.req_pool_idx = None
        self.dec_lock_ref(req.last_node)
        req.last_node = None
        req.prefix_indices = torch.empty(0, dtype=torch.int64)
