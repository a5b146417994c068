"""The conformance class run over every transport: in-process local and NIXL, NIXL transports
on one node reading through mapped memory, and Ray and NIXL with the owner in a Ray actor
(another process, real UCX)."""

from __future__ import annotations

from typing import Any

import pytest

from ._node import Node, node_actor
from .conformance import TransportConformance, unique

SHM = "/dev/shm"


class TestLocalTransport(TransportConformance):
    KIND = "local"


class TestNixlTransportInProcess(TransportConformance):
    KIND = "nixl"


@pytest.mark.ray
@pytest.mark.usefixtures("ray_cluster")
class TestNixlTransportActorOwner(TransportConformance):
    KIND = "nixl"

    @classmethod
    def make_owner(cls, **kw: Any) -> Any:
        return node_actor("nixl", unique("nixl-actor-owner"), **kw)


@pytest.mark.ray
@pytest.mark.usefixtures("ray_cluster")
class TestRayObjectTransport(TransportConformance):
    KIND = "ray"

    @classmethod
    def make_owner(cls, **kw: Any) -> Any:
        return node_actor("ray", unique("ray-actor-owner"), **kw)


class TestMappedSameNodeInProcess(TransportConformance):
    """Two NIXL transports that say they run on one node, the owner's pools in shared memory:
    every read goes through the mapped slab, never NIXL (checked after each test)."""

    KIND = "nixl"
    NODE = "node-same"

    @classmethod
    def make_owner(cls, **kw: Any) -> Any:
        return Node("nixl", unique("mapped-owner"), node=cls.NODE, shared_memory_dir=SHM, **kw)

    @pytest.fixture
    def pair(self, owner: Any) -> Any:
        reader = Node(self.KIND, unique("mapped-reader"), node=self.NODE)
        reader.add_peers([owner.peer_info()])
        assert reader.carrier(owner.peer_info().name) == "mapped"
        yield owner, reader
        reader.close()
