"""The security of a ``kvserve up`` cluster: its CA and certificates, and which flags reach which child.

See ``kvserve.launcher.cluster``'s module docstring; ``security.auth`` for the trust model.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from security.auth import TOKEN_ENV, Security
from security.certs import ClusterCA, write_member
from security.identity import Identity


def split_public_tls(security_argv: list[str]) -> tuple[list[str], list[str]]:
    """(every child's words, the router's ``--tls-*`` words): those serve its public port only."""
    shared, public, words = [], [], iter(security_argv)
    for word in words:
        if word in ("--tls-cert", "--tls-key", "--tls-ca"):
            public += [word, next(words)]
        else:
            shared.append(word)
    return shared, public


def public_security(public_argv: list[str]) -> Security:
    """What a client of the router's public port needs (the launcher checks its health there)."""
    files = dict(zip(public_argv[::2], public_argv[1::2], strict=True))
    return Security(None, *(Path(files[flag]).read_bytes() if flag in files else None
                            for flag in ("--tls-cert", "--tls-key", "--tls-ca")))  # fmt: skip


class ClusterCredentials:
    """What the children of one start get: in their environment, a credential of their role derived from the
    launcher's token (none when insecure); with ``internal_tls``, a certificate of a new cluster CA, whose key
    stays in memory, in ``directory/<child>/`` (``--cluster-certs``). ``launcher`` is the launcher's own
    credentials for its children's internal ports: its token and, with TLS, a certificate of role ``launcher``."""

    LAUNCHER = Identity("launcher", "kvserve-up")

    def __init__(self, security: Security, directory: Path, host: str, internal_tls: bool) -> None:
        self._security, self._host = security, host
        self.tls_dir = directory if internal_tls and security.token is not None else None
        self.launcher = Security(security.token)
        if self.tls_dir is not None:
            self._ca = ClusterCA.new()
            shutil.rmtree(directory, ignore_errors=True)  # a dead launcher's of our pid: nobody's now
            directory.mkdir(mode=0o700)
            cert, key = self._ca.issue(self.LAUNCHER)
            self.launcher = Security(security.token, cert, key, self._ca.cert_pem, self.LAUNCHER)

    def env(self, role: str, env: dict[str, str]) -> dict[str, str]:
        return env if self._security.token is None else {**env, TOKEN_ENV: self._security.credential(role)}

    def argv(self, role: str, name: str) -> list[str]:
        if self.tls_dir is None:
            return []
        path = write_member(self.tls_dir / name, self._ca, Identity(role, name), (self._host,))
        return ["--cluster-certs", str(path)]
