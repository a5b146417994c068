"""Shared pieces of the transport tests: one local Ray cluster per session, small pools.

``UCX_MODULES=^ib`` is set here, before anything imports NIXL: with system libibverbs present a
process holding a UCX backend can crash at exit otherwise (docs/reference.md). Ray workers get it,
and the repository on ``PYTHONPATH``, through the job's runtime environment.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("UCX_MODULES", "^ib")

import pytest

ROOT = Path(__file__).resolve().parents[2]
GROUP_PAGE_BYTES = (4096, 2048)
"""Page sizes of the conformance owners' two layer groups (group 0 is what most tests read)."""


@pytest.fixture(scope="session")
def ray_cluster(tessera_cluster: object) -> Iterator[None]:
    """The session's one shared cluster (tests/conftest.py), under the name these tests use."""
    yield


@pytest.fixture(scope="class")
def owner(request: pytest.FixtureRequest) -> Iterator[Any]:
    """The owner of a conformance class, made once per class by its ``make_owner`` with two
    layer groups: an actor owner costs a process start, readers are cheap and made per test."""
    owner = request.cls.make_owner(page_bytes=GROUP_PAGE_BYTES)
    yield owner
    owner.close()
