"""The conformance class run over every transport: in-process local and NIXL, and Ray and NIXL
with the owner in a Ray actor (another process, real UCX)."""

from __future__ import annotations

from typing import Any

import pytest

from ._node import node_actor
from .conformance import TransportConformance, unique


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
