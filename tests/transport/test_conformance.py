"""The conformance class run over every transport: in-process local and NIXL (reads inline and
on the I/O thread), and Ray and NIXL with the owner in a Ray actor (another process, real UCX)."""

from __future__ import annotations

from typing import Any

import pytest

from ._node import node_actor
from .conformance import TransportConformance, unique


class TestLocalTransport(TransportConformance):
    KIND = "local"


class TestNixlTransportInProcess(TransportConformance):
    """Reads run inside the reader's wait (the default below 4 CPUs)."""

    KIND = "nixl"
    INLINE_READS = True


class TestNixlTransportIOThread(TransportConformance):
    """Reads run on the transport's I/O thread (the default with 4 CPUs or more)."""

    KIND = "nixl"
    INLINE_READS = False


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
