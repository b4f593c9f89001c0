"""What kvserve keeps on a shared host is its user's alone: a pool directory another user (or a link) got to
first is refused, so is a token file another user owns or may read, and no repr shows a secret."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvserve.launcher.cluster import Cluster
from kvstore import KVCacheSpec
from kvstore.shared_pool import SHM_DIR_ENV, create_shared_pool, pool_dir
from security.auth import Security, load_token

OTHER_UID = 4242
as_root = pytest.mark.skipif(os.getuid() != 0, reason="making another user's files needs root")
SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)


@pytest.fixture
def planted(tmp_path, monkeypatch) -> Path:
    """The path this process's pool directory is at (the standalone default is ``/dev/shm/kvserve-<uid>``)."""
    path = tmp_path / "pools"
    monkeypatch.setenv(SHM_DIR_ENV, str(path))
    return path


def test_a_new_pool_directory_is_private(planted):
    old_umask = os.umask(0)
    try:
        assert pool_dir() == planted
    finally:
        os.umask(old_umask)
    assert planted.stat().st_mode & 0o777 == 0o700
    assert pool_dir() == planted  # ours now: taken again


@as_root
def test_a_pool_directory_another_user_made_first_is_refused(planted):
    planted.mkdir(mode=0o700)
    os.chown(planted, OTHER_UID, OTHER_UID)
    with pytest.raises(RuntimeError, match="not a directory owned by this user"):
        create_shared_pool(SPEC, 8, "decode-0")  # what a standalone decode worker does at start
    assert list(planted.iterdir()) == []  # no pool file for its owner to read


def test_a_link_at_the_pool_directory_is_refused(planted, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    planted.symlink_to(elsewhere)
    with pytest.raises(RuntimeError, match="not a directory owned by this user"):
        pool_dir()
    assert list(elsewhere.iterdir()) == []


def test_a_pool_directory_open_to_other_users_is_refused(planted):
    planted.mkdir()
    planted.chmod(0o777)  # anyone may have put files there already
    with pytest.raises(RuntimeError, match="has mode 0777, not 0700"):
        pool_dir()


def _token_file(tmp_path: Path, mode: int, owner: int | None = None) -> Path:
    path = tmp_path / "cluster-token"
    path.write_text("s3cret-token\n")
    path.chmod(mode)
    if owner is not None:
        os.chown(path, owner, owner)
    return path


def test_a_private_token_file_of_ours_is_read(tmp_path):
    assert load_token(str(_token_file(tmp_path, 0o600))) == "s3cret-token"


def test_a_token_file_other_users_may_read_is_refused(tmp_path):
    with pytest.raises(ValueError, match="has mode 0644"):
        load_token(str(_token_file(tmp_path, 0o644)))


@as_root
def test_a_token_file_another_user_owns_is_refused(tmp_path):
    """Private to its owner, but that owner is someone else: they can rewrite the token."""
    with pytest.raises(ValueError, match=f"belongs to uid {OTHER_UID}"):
        load_token(str(_token_file(tmp_path, 0o600, owner=OTHER_UID)))


def test_no_repr_shows_the_token_or_the_tls_key(tmp_path):
    security = Security(token="s3cret-token", tls_cert=b"CERT", tls_key=b"PRIVATE-KEY", tls_ca=b"CA")
    cluster = Cluster("127.0.0.1:1", "redis://:redis-password@127.0.0.1:1/0", tmp_path, security, 5.0)
    for text in (repr(security), str(security), repr(cluster)):
        assert "s3cret-token" not in text and "PRIVATE-KEY" not in text and "redis-password" not in text, text
    assert repr(security) == "Security(token=<hidden>, tls=True, mutual_tls=True)"
    assert repr(Security.insecure()) == "Security(token=None, tls=False, mutual_tls=False)"
