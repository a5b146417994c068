"""Tenant namespaces as a checked boundary, and the size limits of one request.

Every block lives under a namespace (the tenant's). Token keys are chained under it and pages
are hashed with a per-namespace seed, so two tenants never share a page or a key by accident.
That alone does not stop a caller from *naming* another tenant's namespace. A tier started with
a tenant secret therefore takes, wherever a namespace is asked for, a :class:`Credential`: the
tenant's name, the other namespaces it may read (sharing, explicitly configured by whoever holds
the secret), and an HMAC-SHA256 over both. Pools and directory shards check it; a plain string,
a forged or altered credential, or a read outside what it grants is refused with
:class:`~tessera_ray.errors.TenantError` before anything is looked at. Writes go only to the
tenant's own namespace.

A tier started without a secret is open (one trusted user, the demo, tests of other things):
a namespace is a plain string, and credentials are still checked for what they grant.

What this is not: a sandbox. Ray gives no isolation between the code it runs, so anyone who can
run code in the cluster can read any actor's memory; Ray's token authentication (left on) is
what keeps everyone else out. Credentials are the contract between a serving front end (which
authenticates users and holds their credentials) and the tier, and they make a leaked or guessed
token key worthless to another tenant.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass, replace

from tessera_ray.errors import BadRequestError, TenantError

__all__ = [
    "Access",
    "Credential",
    "TenantGate",
    "MAX_BATCH_KEYS",
    "check_batch",
]

MAX_BATCH_KEYS = 1 << 16
"""Most token keys one call may carry: 4M tokens of 64-token blocks, far more than one request
needs; a larger batch is refused whole (it would hold an actor for seconds and its reply would
not fit a message), so a hostile or buggy caller cannot stall a pool or a shard."""

_MAC_DOMAIN = b"tessera-ray tenant credential v1\x00"


@dataclass(frozen=True, slots=True)
class Credential:
    """A tenant's right to write its namespace and read it plus ``reads``.

    ``acting_on`` picks which namespace a call addresses (default: the tenant's own); the MAC
    covers the tenant and the grants, not that choice, so one credential serves every
    namespace it grants.
    """

    tenant: str
    reads: tuple[str, ...]
    mac: bytes
    acting_on: str = ""

    @property
    def namespace(self) -> str:
        return self.acting_on or self.tenant

    def on(self, namespace: str) -> Credential:
        """This credential addressing ``namespace`` (its own or one shared with it)."""
        if namespace != self.tenant and namespace not in self.reads:
            raise TenantError(
                f"tenant {self.tenant!r} is not granted namespace {namespace!r} "
                f"(granted: {[self.tenant, *self.reads]}); ask the operator to share it"
            )
        return replace(self, acting_on=namespace)

    def __repr__(self) -> str:  # keep the MAC out of logs
        return f"Credential(tenant={self.tenant!r}, reads={self.reads!r}, on={self.namespace!r})"


Access = str | Credential
"""What a call names a namespace with: a plain string on an open tier, a credential on a tier
started with a tenant secret."""


def _mac(secret: bytes, tenant: str, reads: tuple[str, ...]) -> bytes:
    # Length-prefixed fields: no two (tenant, reads) pairs encode alike.
    msg = bytearray(_MAC_DOMAIN)
    for field in (tenant, *reads):
        raw = field.encode("utf-8")
        msg += len(raw).to_bytes(4, "big") + raw
    return hmac.new(secret, bytes(msg), hashlib.sha256).digest()


def _check_name(name: object, what: str) -> str:
    if not isinstance(name, str) or not name or len(name) > 256 or "\x00" in name:
        raise TenantError(f"{what} must be a non-empty str of at most 256 chars, got {name!r:.60}")
    return name


class TenantGate:
    """Turns what a caller presented into the namespace it may use, or refuses."""

    def __init__(self, secret: bytes | None = None) -> None:
        if secret is not None and (not isinstance(secret, bytes) or len(secret) < 16):
            raise TenantError("a tenant secret must be at least 16 bytes")
        self._secret = secret

    @property
    def closed(self) -> bool:
        """True when a credential is required."""
        return self._secret is not None

    def issue(self, tenant: str, reads: Iterable[str] = ()) -> Credential:
        """A credential for ``tenant`` that may also read ``reads`` (needs the secret)."""
        if self._secret is None:
            raise TenantError("this tier has no tenant secret; it cannot issue credentials")
        _check_name(tenant, "tenant")
        grants = tuple(sorted({_check_name(r, "shared namespace") for r in reads} - {tenant}))
        return Credential(tenant, grants, _mac(self._secret, tenant, grants))

    def for_pool(self, namespace: str) -> Access:
        """What a pool (which holds the secret) presents to the directory for ``namespace``."""
        return self.issue(namespace) if self._secret is not None else namespace

    def resolve(self, access: object, *, write: bool) -> str:
        """The namespace ``access`` may use for a read (or a ``write``); raises
        :class:`TenantError` naming what is wrong."""
        if isinstance(access, Credential):
            _check_name(access.tenant, "tenant")
            ns = _check_name(access.namespace, "namespace")
            if not isinstance(access.reads, tuple):
                raise TenantError(f"credential grants must be a tuple, got {access.reads!r:.60}")
            for granted in access.reads:
                _check_name(granted, "shared namespace")
            if not isinstance(access.mac, bytes) or len(access.mac) != hashlib.sha256().digest_size:
                raise TenantError("credential MAC must be 32 bytes; ask the operator for a new one")
            if self._secret is not None and not hmac.compare_digest(
                access.mac, _mac(self._secret, access.tenant, tuple(access.reads))
            ):
                raise TenantError(
                    f"credential for tenant {access.tenant!r} does not verify (forged or "
                    f"altered); ask the operator for a new one"
                )
            if write and ns != access.tenant:
                raise TenantError(
                    f"tenant {access.tenant!r} may read namespace {ns!r} but not write it"
                )
            if ns != access.tenant and ns not in access.reads:
                raise TenantError(f"tenant {access.tenant!r} is not granted namespace {ns!r}")
            return ns
        if self._secret is not None:
            raise TenantError(
                f"this tier requires a tenant credential, got {type(access).__name__} "
                f"{access!r:.40}; ask the operator (TesseraClient.issue_credential)"
            )
        return _check_name(access, "namespace")


def check_batch(count: int, what: str = "token keys") -> None:
    """Refuse a batch larger than :data:`MAX_BATCH_KEYS` before any work is done."""
    if count > MAX_BATCH_KEYS:
        raise BadRequestError(
            f"{count} {what} in one call; at most {MAX_BATCH_KEYS} (split the request)"
        )
