"""Keys per purpose, derived from the cluster secret, and the share of them each role holds.

The cluster secret (the token: ``KVSERVE_CLUSTER_TOKEN``, a token file, or what ``kvserve up`` makes) is
never a key itself and never goes on the wire. One key is derived from it per purpose:

* ``registry`` signs what workers publish about themselves in Redis (purposes ``worker``, ``worker-load``);
  every member holds it, to verify those records;
* ``lease`` signs the lease a decode worker grants with a ``Prefill`` call (``lease-grant``), its record in
  Redis (``lease-record``) and its writer's end of it (``lease-end``); decode and prefill workers only;
* ``call-ROLE`` is the token a caller of that role sends when internal calls run without mutual TLS
  (with it, the caller's certificate says its role instead); a server holds the tokens of the roles that
  may call it (``CALLERS``).

Every signature starts with its purpose, so no record of one kind verifies as another. The holder of the
secret itself holds every key (role ``member``: tests, tools, the ``kvserve up`` launcher, a process given
the secret); ``kvserve up`` and ``kvserve certs`` give each process a credential of its role instead
(``Keyring.credential``), holding ``ROLE_KEYS[role]`` only. The router, which faces the internet, so holds
the registry key and its own call token: it can verify workers and call Decode, and cannot sign a lease.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

MEMBER = "member"  # the holder of the cluster secret: any role
CREDENTIAL_PREFIX = "kvserve-credential-v1."
PURPOSE_KEYS = {"worker": "registry", "worker-load": "registry", "lease-grant": "lease", "lease-record": "lease",
                "lease-end": "lease"}  # fmt: skip
CALLERS = {"kvserve.v1.Decode": ("router",), "kvserve.v1.Prefill": ("decode",),
           "kvserve.v1.KVTransfer": ("prefill",)}  # fmt: skip
ROLE_KEYS = {
    "router": ("registry", "call-router"),
    "decode": ("registry", "lease", "call-decode", "call-router", "call-prefill"),
    "prefill": ("registry", "lease", "call-prefill", "call-decode"),
}
_KINDS = ("registry", "lease", "call-member", *(f"call-{role}" for role in ROLE_KEYS))


def derive(secret: str, kind: str) -> bytes:
    """The key of ``kind`` that ``secret`` stands for."""
    return hmac.new(secret.encode(), f"kvserve-key/{kind}".encode(), hashlib.sha256).digest()


@dataclass(frozen=True)
class Keyring:
    """The keys one process holds, by kind (see the module docstring); ``role`` is whose credential it is."""

    role: str
    keys: Mapping[str, bytes] = field(repr=False)

    @classmethod
    def from_token(cls, token: str | None) -> Keyring:
        """The keys a token stands for: a role credential's own, the cluster secret's every key, or (no token:
        ``--insecure-internal``) every key empty, so signatures catch mistakes only."""
        if token is None:
            return cls(MEMBER, dict.fromkeys(_KINDS, b""))
        if not token.startswith(CREDENTIAL_PREFIX):
            return cls(MEMBER, {kind: derive(token, kind) for kind in _KINDS})
        try:
            data = json.loads(base64.urlsafe_b64decode(token[len(CREDENTIAL_PREFIX) :].encode()))
            role, keys = data["role"], {kind: bytes.fromhex(key) for kind, key in data["keys"].items()}
        except (ValueError, KeyError, TypeError, AttributeError, binascii.Error) as err:
            raise ValueError(f"the cluster token looks like a kvserve credential but does not parse ({err})") from None
        if role not in ROLE_KEYS:
            raise ValueError(f"the cluster credential is for role {role!r}, not one of {tuple(ROLE_KEYS)}")
        return cls(role, keys)

    def credential(self, role: str) -> str:
        """A token that holds ``role``'s keys only; only the holder of the cluster secret can issue one."""
        if role not in ROLE_KEYS:
            raise ValueError(f"no credential for role {role!r}: expected one of {tuple(ROLE_KEYS)}")
        if self.role != MEMBER:
            raise ValueError(f"a {self.role}'s credential cannot issue credentials: give the cluster secret")
        keys = {kind: self.keys[kind].hex() for kind in ROLE_KEYS[role]}
        text = json.dumps({"role": role, "keys": keys}, separators=(",", ":"))
        return CREDENTIAL_PREFIX + base64.urlsafe_b64encode(text.encode()).decode()

    # -- signatures -------------------------------------------------------------------------------------

    def sign(self, purpose: str, *parts: object) -> str:
        """HMAC-SHA256 of ``purpose`` and ``parts`` under the purpose's key; ``PermissionError`` when this
        credential does not hold it (the router signs no lease)."""
        key = self.keys.get(PURPOSE_KEYS[purpose])
        if key is None:
            raise PermissionError(f"a {self.role} credential holds no {PURPOSE_KEYS[purpose]} key: it cannot sign "
                                  f"{purpose} records")  # fmt: skip
        return _mac(key, purpose, parts)

    def verify(self, signature: str, purpose: str, *parts: object) -> bool:
        key = self.keys.get(PURPOSE_KEYS[purpose])
        return key is not None and hmac.compare_digest(signature.encode(), _mac(key, purpose, parts).encode())

    # -- calls without mutual TLS -------------------------------------------------------------------------

    @property
    def call_token(self) -> str:
        """What this process sends as its token on an internal call (its role's call key)."""
        return self.keys[f"call-{self.role}"].hex()

    def call_refusal(self, service: str, role: str, token: str) -> str:
        """'' when a caller claiming ``role`` with ``token`` may call ``service``, else why not (the token is
        checked first, in constant time: a wrong one says nothing about roles)."""
        key = self.keys.get(f"call-{role}")
        if not key or not hmac.compare_digest(token.encode(), key.hex().encode()):
            return "unauthenticated"
        if role != MEMBER and role not in CALLERS[service]:
            return f"a {role} may not call {service} (only {', '.join(CALLERS[service])})"
        return ""


def _mac(key: bytes, purpose: str, parts: tuple[object, ...]) -> str:
    message = "\x1f".join([purpose, *(str(p) for p in parts)]).encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()
