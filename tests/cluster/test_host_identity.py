"""``local_host_id``: two workers share a host exactly when they can share memory, i.e. map the same files of
the same shared-memory filesystem on the same running kernel; their network namespace plays no part."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cluster_state.workers import WorkerInfo, local_host_id
from kvserve.testing import netns
from kvstore.shared_pool import SHM_DIR_ENV

SHM = Path("/dev/shm")
_PRINT_ID = ("import sys, pathlib; from cluster_state.workers import local_host_id; "
             "print(local_host_id(pathlib.Path(sys.argv[1])))")


def test_one_filesystem_is_one_host_and_another_is_not(tmp_path):
    (tmp_path / "a").mkdir()
    assert local_host_id(tmp_path / "a") == local_host_id(tmp_path)
    assert local_host_id(tmp_path / "not" / "made" / "yet") == local_host_id(tmp_path)  # its nearest ancestor's
    assert local_host_id(Path("/proc")) != local_host_id(Path("/"))  # procfs and the root filesystem differ


def test_it_follows_the_pool_directory_and_names_the_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv(SHM_DIR_ENV, str(tmp_path / "pools"))
    assert local_host_id() == local_host_id(tmp_path)
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert local_host_id().startswith(f"{boot_id}/shm-")
    assert WorkerInfo("decode-0", "decode", "h:1").host_id == local_host_id()


@pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm")
def test_another_network_namespace_is_the_same_host_unless_its_dev_shm_is_its_own():
    if reason := netns.unavailable():
        pytest.skip(reason)
    ours = local_host_id(SHM)
    with netns.Hosts(1) as hosts:
        [host] = hosts.hosts
        plain = ["ip", "netns", "exec", host.name, sys.executable, "-c", _PRINT_ID, str(SHM)]  # /dev/shm is ours
        private = hosts.command(host, [sys.executable, "-c", _PRINT_ID, str(SHM)])  # a fresh tmpfs on /dev/shm
        runs = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
                for argv in (plain, private)]  # fmt: skip
        shared_id, private_id = (run.communicate(timeout=60)[0].strip() for run in runs)
    assert shared_id == ours
    assert private_id and private_id != ours and private_id.split("/")[0] == ours.split("/")[0]  # one kernel
    assert not netns.ours()
