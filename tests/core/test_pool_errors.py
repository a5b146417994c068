"""Bad input raises a specific error and leaves the pool exactly as it was."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tessera_ray.core import BlockPool, PoolConfig, token_key
from tessera_ray.errors import (
    ForgedHandleError,
    PageBoundsError,
    PageDTypeError,
    PageNotFreeableError,
    PageNotSealedError,
    PageSealedError,
    PageShapeError,
    PoolConfigError,
    PoolError,
    PoolExhaustedError,
    PoolMemoryError,
    StaleHandleError,
    UnknownNameError,
)
from tests.core.conftest import FINGERPRINT, make_pool, page_of, tiny_spec


@pytest.fixture
def setup() -> tuple[BlockPool, dict[str, object]]:
    return pool_with_handles()


def pool_with_handles() -> tuple[BlockPool, dict[str, object]]:
    """A pool holding one page in each state, and a handle to each (also used by the chaos
    suite's hostile-input campaign)."""
    pool = make_pool(4, layers_per_block=1)
    w = pool.allocate()
    s = pool.seal(pool.write(pool.allocate(), page_of(1)), "t").handle
    freed = pool.allocate()
    pool.release(freed)
    lru = pool.seal(pool.write(pool.allocate(), page_of(2)), "t").handle
    pool.release(lru)
    return pool, {"writable": w, "sealed": s, "freed": freed, "lru": lru}


def snapshot(pool: BlockPool) -> tuple[object, ...]:
    refs = tuple((r.state, r.refcount, r.generation) for r in pool._pages)  # slot order
    return pool.stats(), pool.data.clone(), refs


def assert_unchanged(pool: BlockPool, before: tuple[object, ...]) -> None:
    after = snapshot(pool)
    assert after[0] == before[0] and after[2] == before[2]
    assert torch.equal(after[1], before[1])  # type: ignore[arg-type]
    pool.check_consistency()


U8 = torch.uint8
CASES: list[tuple[str, type[Exception], Callable[[BlockPool, dict[str, object]], object]]] = [
    (
        "write past page",
        PageBoundsError,
        lambda p, h: p.write(h["writable"], page_of(0)[:8], offset=60),
    ),
    (
        "write negative offset",
        PageBoundsError,
        lambda p, h: p.write(h["writable"], page_of(0)[:1], offset=-1),
    ),
    (
        "write too long",
        PageBoundsError,
        lambda p, h: p.write(h["writable"], torch.zeros(65, dtype=U8)),
    ),
    ("write wrong dtype", PageDTypeError, lambda p, h: p.write(h["writable"], torch.zeros(8))),
    ("write not a tensor", PageDTypeError, lambda p, h: p.write(h["writable"], b"abc")),  # type: ignore[arg-type]
    (
        "write wrong shape",
        PageShapeError,
        lambda p, h: p.write(h["writable"], torch.zeros(2, 4, dtype=U8)),
    ),
    (
        "region wrong dtype",
        PageDTypeError,
        lambda p, h: p.write_region(h["writable"], "k_rope", torch.zeros(4, 2)),
    ),
    (
        "region wrong shape",
        PageShapeError,
        lambda p, h: p.write_region(
            h["writable"], "k_rope", torch.zeros(4, 3, dtype=torch.bfloat16)
        ),
    ),
    (
        "region past page",
        PageBoundsError,
        lambda p, h: p.write_region(
            h["writable"], "k_rope", torch.zeros(2, 2, dtype=torch.bfloat16), start_entry=3
        ),
    ),
    (
        "unknown region",
        UnknownNameError,
        lambda p, h: p.write_region(h["writable"], "nope", torch.zeros(1)),
    ),
    ("seal twice", PageSealedError, lambda p, h: p.seal(h["sealed"], "t")),
    ("share writable", PageNotSealedError, lambda p, h: p.share(h["writable"])),
    ("release free page", StaleHandleError, lambda p, h: p.release(h["freed"])),
    ("release unreferenced", PageNotFreeableError, lambda p, h: p.release(h["lru"])),
    ("write unreferenced", PageNotFreeableError, lambda p, h: p.write(h["lru"], page_of(0)[:1])),
    (
        "release_many over",
        PageNotFreeableError,
        lambda p, h: p.release_many([h["sealed"], h["sealed"]]),
    ),
    ("stale handle", StaleHandleError, lambda p, h: p.read(h["freed"])),
    (
        "forged generation",
        ForgedHandleError,
        lambda p, h: p.read(h["sealed"]._replace(generation=7)),
    ),
    (
        "forged offset",
        ForgedHandleError,
        lambda p, h: p.read(h["sealed"]._replace(offset=3)),
    ),
    (
        "forged out of range",
        ForgedHandleError,
        lambda p, h: p.read(h["sealed"]._replace(offset=64 * 99)),
    ),
    (
        "forged length",
        ForgedHandleError,
        lambda p, h: p.read(h["sealed"]._replace(length=32)),
    ),
    (
        "forged region",
        ForgedHandleError,
        lambda p, h: p.read(h["sealed"]._replace(region=-5)),
    ),
    ("forged type", ForgedHandleError, lambda p, h: p.read((0, 0, 64, 0))),  # type: ignore[arg-type]
    (
        "block wrong size",
        PageShapeError,
        lambda p, h: p.seal_block([h["writable"], h["sealed"]], "t"),
    ),
    ("bad token key", PageShapeError, lambda p, h: p.seal_block([h["writable"]], "t", b"short")),  # type: ignore[arg-type]
    (
        "register unsealed",
        PageNotSealedError,
        lambda p, h: p.register_block([h["writable"]], "t", token_key("t", FINGERPRINT, None, [1])),
    ),
    (
        "register other tenant",
        PageNotSealedError,
        lambda p, h: p.register_block([h["sealed"]], "u", token_key("u", FINGERPRINT, None, [1])),
    ),
    ("seal empty namespace", PoolConfigError, lambda p, h: p.seal(h["writable"], "")),
    ("evict negative", PoolConfigError, lambda p, h: p.evict(-1)),
    ("allocate too many", PoolExhaustedError, lambda p, h: p.allocate_many(3)),
]


@pytest.mark.parametrize(("name", "error", "call"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_and_changes_nothing(
    setup: tuple[BlockPool, dict[str, object]],
    name: str,
    error: type[Exception],
    call: Callable[[BlockPool, dict[str, object]], object],
) -> None:
    pool, handles = setup
    before = snapshot(pool)
    with pytest.raises(error) as info:
        call(pool, handles)
    assert isinstance(info.value, PoolError | UnknownNameError)
    assert str(info.value)  # messages say what was wrong
    assert_unchanged(pool, before)


def test_handle_of_another_pool_is_forged() -> None:
    a, b = make_pool(2), make_pool(2)
    h = a.allocate()
    b.allocate()
    with pytest.raises(ForgedHandleError):
        b.read(h)


def test_cow_with_no_free_page_raises_and_changes_nothing() -> None:
    pool = make_pool(1)
    s = pool.seal(pool.write(pool.allocate(), page_of(1)), "t").handle
    before = snapshot(pool)
    with pytest.raises(PoolExhaustedError, match="evict"):
        pool.write(s, page_of(2)[:1])
    assert_unchanged(pool, before)


def test_pool_larger_than_memory_refused_before_allocating() -> None:
    with pytest.raises(PoolMemoryError, match="does not fit") as info:
        BlockPool(tiny_spec(), PoolConfig(num_pages=2**50), fingerprint=FINGERPRINT)
    assert isinstance(info.value, MemoryError)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_pages": 0},
        {"num_pages": -3},
        {"num_pages": 1.5},
        {"num_pages": True},
        {"num_pages": 1, "device": "tpu"},
        {"num_pages": 1, "max_memory_fraction": 0.0},
        {"num_pages": 1, "device": "cuda", "pin_memory": True},
    ],
)
def test_config_validated(kwargs: dict[str, object]) -> None:
    with pytest.raises(PoolConfigError):
        PoolConfig(**kwargs)  # type: ignore[arg-type]


def test_pool_args_validated() -> None:
    with pytest.raises(PoolConfigError):
        BlockPool(tiny_spec(), PoolConfig(num_pages=1), fingerprint="")
    with pytest.raises(PoolConfigError):
        BlockPool(tiny_spec(), PoolConfig(num_pages=1), fingerprint="f", layers_per_block=0)
