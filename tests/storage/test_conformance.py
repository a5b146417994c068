"""Every tier passes the same conformance class."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera_ray.storage import HostMemoryTier, StorageTier
from tessera_ray.storage._format import HEADER_BYTES

from .conformance import TierConformance
from .conftest import HASH, open_disk


class TestHostMemoryTier(TierConformance):
    def make_tier(self, capacity_pages: int = 64) -> StorageTier:
        return HostMemoryTier(capacity_pages * 300, 300, hasher=HASH)


class TestDiskTier(TierConformance):
    @pytest.fixture(autouse=True)
    def _root(self, tmp_path: Path) -> None:
        self.root = tmp_path / "tier"

    def make_tier(self, capacity_pages: int = 64) -> StorageTier:
        return open_disk(self.root, capacity_pages * (256 + HEADER_BYTES))
