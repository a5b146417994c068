"""What the client decides without Ray: which pool serves each block of a fetch or an attend,
and the answers it assembles from the pools' replies.

Kept apart from :mod:`~tessera_ray.actors.client` so the decisions load and test without Ray;
the client makes the calls and feeds the replies back in here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import torch

from tessera_ray.actors.directory import Holder, LookupResult, Tier
from tessera_ray.actors.messages import BlockFailure, FetchFailure
from tessera_ray.core.results import TokenKey

__all__ = ["FetchResult", "FetchPlan", "assign_holders", "merge_partials"]


@dataclass(frozen=True, slots=True)
class FetchResult:
    """Per requested key: where it is now available in the target pool, or why not."""

    pool: str
    local_hits: tuple[TokenKey, ...]
    fetched: tuple[TokenKey, ...]
    missed: tuple[TokenKey, ...]
    failed: dict[TokenKey, BlockFailure] = field(default_factory=dict)
    """Keys no pool could supply, with the last owner's reason."""

    @property
    def available(self) -> set[TokenKey]:
        return set(self.local_hits) | set(self.fetched)


class FetchPlan:
    """One fetch into pool ``into``: the local hits, the misses, and for every other key the
    pools still to pull it from, best first: memory replicas, then ``into``'s own disk (a
    restore reads no network), then other pools' disks. ``holders[i]``: where a lookup found
    ``token_keys[i]`` (``None``: a miss)."""

    def __init__(
        self,
        into: str,
        token_keys: Sequence[TokenKey],
        holders: Sequence[Sequence[Holder] | None],
    ) -> None:
        self.into = into
        self._keys = token_keys
        self._holders = holders
        self.local: list[TokenKey] = []
        self.missed: list[TokenKey] = []
        self.pending: dict[TokenKey, list[str]] = {}
        self.fetched: list[TokenKey] = []
        self.failed: dict[TokenKey, BlockFailure] = {}
        for key, held in zip(token_keys, holders, strict=True):
            if not held:
                self.missed.append(key)
            elif any(h.pool == into and h.tier == Tier.MEMORY for h in held):
                self.local.append(key)
            else:
                order = sorted(held, key=lambda h: (h.tier != Tier.MEMORY, h.pool != into))
                self.pending[key] = list(dict.fromkeys(rep.pool for rep in order))

    def confirm_local(self, held: Sequence[Tier | None]) -> None:
        """Apply what ``into`` says it holds of :attr:`local` (the directory may lag an
        eviction): a hit it no longer has in memory is pulled like any other key, from its own
        disk first when it kept it there."""
        for key, tier in zip(list(self.local), held, strict=True):
            if tier != Tier.MEMORY:
                self.local.remove(key)
                holders = self._holders[self._keys.index(key)] or ()
                others = [h.pool for h in holders if h.pool != self.into]
                if tier == Tier.DISK:
                    others.insert(0, self.into)
                if others:
                    self.pending[key] = list(dict.fromkeys(others))
                else:
                    self.missed.append(key)

    @classmethod
    def of_lookup(
        cls, into: str, token_keys: Sequence[TokenKey], results: Sequence[LookupResult | None]
    ) -> FetchPlan:
        """The plan for a directory lookup's answer."""
        return cls(into, token_keys, [Holder.of(r) if r is not None else None for r in results])

    def by_owner(self) -> dict[str, list[TokenKey]]:
        """The pending keys grouped by the pool to try next: one pull per owner per round."""
        out: dict[str, list[TokenKey]] = {}
        for key, owners in self.pending.items():
            out.setdefault(owners[0], []).append(key)
        return out

    @staticmethod
    def owner_lost(reasons: Sequence[BlockFailure | None]) -> bool:
        """Whether an owner's answer says it is gone (the directory should forget it)."""
        return any(r is not None and r.reason is FetchFailure.OWNER_UNAVAILABLE for r in reasons)

    def settle(
        self, owner_keys: Sequence[TokenKey], reasons: Sequence[BlockFailure | None]
    ) -> None:
        """Record one owner's answer: a key it supplied is fetched; one it did not moves on to
        its next owner, or fails with this reason when none is left."""
        for key, reason in zip(owner_keys, reasons, strict=True):
            if reason is None:
                self.fetched.append(key)
                del self.pending[key]
                continue
            self.pending[key].pop(0)
            if not self.pending[key]:
                self.failed[key] = reason
                del self.pending[key]

    async def run(
        self,
        fetch_from: Callable[[str, list[TokenKey]], Awaitable[Sequence[BlockFailure | None]]],
        purge: Callable[[str], Awaitable[None]],
    ) -> FetchResult:
        """Pull every pending key: one ``fetch_from(owner, keys)`` per owner per round, all at
        once; an owner found gone is purged (``purge(owner)``) and its keys move on to their
        next holder. Written once for the client and for a pool pulling for its engine."""
        while self.pending:
            by_owner = self.by_owner()
            answers = await asyncio.gather(*(fetch_from(o, ks) for o, ks in by_owner.items()))
            for (owner, owner_keys), reasons in zip(by_owner.items(), answers, strict=True):
                if self.owner_lost(reasons):
                    await purge(owner)
                self.settle(owner_keys, reasons)
        return self.result()

    def result(self) -> FetchResult:
        return FetchResult(
            self.into, tuple(self.local), tuple(self.fetched), tuple(self.missed), self.failed
        )


def assign_holders(results: Sequence[LookupResult | None]) -> dict[str, list[int]]:
    """Positions of the blocks per pool that attends over them: each block goes to one pool
    holding it in memory. Raises ``LookupError`` naming blocks no pool holds in memory."""
    assigned: dict[str, list[int]] = {}
    absent = []
    for i, r in enumerate(results):
        owners = [rep.pool for rep in r.replicas if rep.tier == Tier.MEMORY] if r else []
        if not owners:
            absent.append(i)
            continue
        # Spread blocks over their holders; any holder gives the same bytes.
        assigned.setdefault(min(owners, key=lambda p: len(assigned.get(p, ()))), []).append(i)
    if absent:
        raise LookupError(f"blocks {absent} of the sequence are in no pool's memory")
    return assigned


def merge_partials(
    pools: Sequence[str], partials: Sequence[tuple[torch.Tensor, torch.Tensor, Sequence[int]]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the pools' partial ``(out, lse, missing)`` exactly (LSE merge). Raises
    ``LookupError`` when a pool lost blocks since the lookup (the caller retries)."""
    # Imported on use: only attention needs the kernels package, not the rest of the client.
    from tessera_ray.kernels import merge_attention_states

    for p, (_, _, missing) in zip(pools, partials, strict=True):
        if missing:
            raise LookupError(f"pool {p} no longer holds blocks {missing}; retry")
    return merge_attention_states([o for o, _, _ in partials], [lse for _, lse, _ in partials])
