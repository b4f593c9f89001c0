"""The ranks of a tensor-parallel engine (``tensor_parallel_size`` > 1), as vLLM v1's engine core drives its
workers: rank 0 is the engine's own process (scheduler, block tables, sampling, everything above the model)
and ranks 1.. are processes it starts, each holding its part of the weights (``engine.models.tensor_parallel``)
and of the KV pool: its KV heads of the same blocks, so that one block table serves every rank.

Rank 0's model is a ``ShardedModel`` (``engine.tensor_parallel_model``): each call the runner makes on it is
first sent to every rank down its standard input (a step's inputs and attention metadata for a forward pass;
the hidden rows for the LM head), then run on rank 0's part; the collectives inside (two all-reduces a layer,
the logits' gather) pair the ranks up. Nothing but the plans crosses the pipes, and nothing but sums and
logits the process group (gloo on the CPU, NCCL on CUDA, one GPU per rank). Padded decode steps go through
``ShardedDecode`` instead: each rank replays CUDA graphs of its own, from the staged inputs rank 0 sends. On
CUDA each rank exports its part of the KV pool to rank 0 through CUDA IPC, as the CPU's ranks share files.

Failure: a rank that cannot join the group within ``tensor_parallel_timeout_s`` fails the engine's start; a
collective that waits longer than that (a rank hung or gone) raises in the step; a rank whose engine process
is gone exits (its standard input ends).
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.heap import freeze_startup_heap, keep_freed_memory
from engine.model_config import ModelConfig
from engine.models.linear import pack_for_onednn
from engine.models.loader import load_model
from engine.models.tensor_parallel import Group, RankLost, Shard, gather_logits
from engine.tensor_parallel_model import from_host, rank_decode_steps, run_rank_step
from kvstore import KVCache, KVCacheSpec
from kvstore.block_copier import BlockCopier
from kvstore.host_tier import HostTier
from kvstore.ipc_pool import export_cuda_ipc, handle_from_tensor, handle_to_tensor, open_cuda_ipc_pool
from kvstore.shared_pool import create_part_files, map_pool_file

log = logging.getLogger(__name__)

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(rank: int, size: int, port: int, device: torch.device, timeout_s: float) -> Group:
    """This process as rank ``rank`` of the group that meets at 127.0.0.1:``port``."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=timeout)
    if device.type == "cuda":  # (as torch.distributed builds one: options carry the timeout)
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream, options._timeout = False, timeout
        return Group(rank, size, dist.ProcessGroupNCCL(store, rank, size, options))
    return Group(rank, size, dist.ProcessGroupGloo(store, rank, size, timeout))


def kv_spec(config: ModelConfig, engine: EngineConfig, dtype: torch.dtype) -> KVCacheSpec:
    """The KV pool's layout for a model of shape ``config`` (under tensor parallelism, a rank's)."""
    return KVCacheSpec(num_layers=config.num_layers, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                       block_size=engine.block_size, dtype=dtype, kv_cache_dtype=engine.kv_cache_dtype)  # fmt: skip


# -- rank 0 ------------------------------------------------------------------------------------------------


class Ranks:
    """Rank 0's handle on ranks 1..size-1: started at construction (they load their parts of the weights while
    rank 0 loads its own), given the pool's size by ``allocate``, sent plans by ``send``, stopped by ``close``.
    Each is a new Python running ``_RANK_MAIN`` (not a fork: CUDA and OpenMP state do not survive one;
    not multiprocessing's spawn, which runs the caller's main module again), its plans pickled down its stdin."""

    def __init__(self, path: Path, model_config: ModelConfig, config: EngineConfig, dtype: torch.dtype,
                 device: torch.device) -> None:  # fmt: skip
        self.size = config.tensor_parallel_size
        self.on_cpu, self.device = device.type == "cpu", device
        self.part_handles: list[bytes] = []  # on CUDA, the exported KV pools of ranks 1.. (``allocate``)
        self.specs = [kv_spec(Shard.of(model_config, rank, self.size).config(), config, dtype)
                      for rank in range(1, self.size)]  # the KV pools of ranks 1..  # fmt: skip
        port = _free_port()
        threads = max(1, torch.get_num_threads() // self.size) if device.type == "cpu" else 1
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # (this process's imports)
        self._processes: list[subprocess.Popen] = []
        for rank in range(1, self.size):
            process = subprocess.Popen([sys.executable, "-c", _RANK_MAIN], stdin=subprocess.PIPE, env=env)
            self._processes.append(process)
            self._write(process, (path, model_config, config, rank, port, threads))
        if device.type == "cpu":
            torch.set_num_threads(threads)  # the cores are shared by the ranks: no two busy pools on one
        try:
            self.group = _join(0, self.size, port, device, config.tensor_parallel_timeout_s)
        except Exception as error:
            self.close()
            raise RuntimeError(f"tensor_parallel_size={self.size}: the ranks did not join within "
                               f"{config.tensor_parallel_timeout_s:g} s (tensor_parallel_timeout_s): "
                               f"{error}") from error  # fmt: skip
        log.info("tensor parallel: %d ranks (%s), %d threads each", self.size,
                 "NCCL" if device.type == "cuda" else "gloo", threads)  # fmt: skip

    @staticmethod
    def _write(process: subprocess.Popen, message) -> None:
        pickle.dump(message, process.stdin, protocol=pickle.HIGHEST_PROTOCOL)
        process.stdin.flush()

    def allocate(self, num_blocks: int, name: str) -> tuple[list[KVCache], list[Path]]:
        """Every rank allocates its part of a pool of ``num_blocks`` blocks (rank 0 chose the number) and returns
        those parts as this process reaches them, and their files. On the CPU each in a pool file named for
        ``name`` (``create_part_files``) that this process maps too; the caller removes the files once nobody
        else will map them. On CUDA each in its own GPU, exported through CUDA IPC (``part_handles``, gathered
        to this process, which opens them: ``kvstore.ipc_pool``); no files."""
        if self.on_cpu:
            return self._parts("allocate", num_blocks, name)
        self.send("allocate", (num_blocks, []))
        gathered = self.group.gather(handle_to_tensor(b"", self.device))  # (rank 0's own is not needed)
        self.part_handles = [handle_from_tensor(t) for t in gathered[1:]]
        return [open_cuda_ipc_pool(spec, num_blocks, handle)
                for spec, handle in zip(self.specs, self.part_handles, strict=True)], []  # fmt: skip

    def host_tier(self, num_slots: int, copier: BlockCopier, name: str) -> tuple[ShardedCopier, list[KVCache]]:
        """Every rank keeps a host tier of ``num_slots`` slots for its heads, on the CPU in a pool file this process
        maps too (the disk tier below reads and writes whole heads: the parts are returned; ``[]`` on CUDA);
        rank 0's copies go through the ``ShardedCopier`` returned, which makes each on every rank too."""
        parts, paths = self._parts("host_tier", num_slots, f"{name}-host")
        for path in paths:  # (nobody else maps a host tier)
            path.unlink(missing_ok=True)
        return ShardedCopier(copier, self), parts

    def _parts(self, op: str, num_blocks: int, name: str) -> tuple[list[KVCache], list[Path]]:
        paths = create_part_files(self.specs, num_blocks, name) if self.on_cpu else []
        try:
            self.send(op, (num_blocks, [str(p) for p in paths]))
            self.group.barrier()  # every rank has its part: the files may be removed from now on
        except BaseException:
            for path in paths:
                path.unlink(missing_ok=True)
            raise
        return [map_pool_file(spec, num_blocks, p) for spec, p in zip(self.specs, paths, strict=True)], paths

    def sync(self) -> None:
        """Returns once every rank has run every plan sent so far, its copies included."""
        self.send("sync", None)
        self.group.barrier()

    def send(self, op: str, payload) -> None:
        for process in self._processes:
            try:
                if process.poll() is not None:
                    raise BrokenPipeError(f"it exited ({process.returncode})")
                self._write(process, (op, payload))
            except (BrokenPipeError, OSError) as error:
                raise RankLost(f"tensor parallel rank process {process.pid} is gone ({error}): the engine cannot "
                               "run without it") from error  # fmt: skip

    def close(self) -> None:
        for process in self._processes:
            try:
                self._write(process, ("stop", None))
                process.stdin.close()
            except (BrokenPipeError, OSError, ValueError):
                pass
        for process in self._processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._processes = []


class ShardedCopier:
    """Rank 0's ``BlockCopier`` under tensor parallelism: each copy between the pool and the host tier is sent
    to every rank (their pools and host tiers hold their heads of the same blocks and slots), then made here.
    A rank orders its next step after its copies itself; waiting on the host is rank 0's alone (its own tier's
    slots are the ones the engine reads and writes on the host)."""

    def __init__(self, copier: BlockCopier, ranks: Ranks) -> None:
        self.copier, self.ranks = copier, ranks
        self._unsynced = False  # copies sent to the ranks since they were last known done

    def to_host(self, views, block_ids, host, slots) -> None:
        if block_ids:
            self.ranks.send("to_host", (list(block_ids), list(slots)))
            self._unsynced = True
        self.copier.to_host(views, block_ids, host, slots)

    def to_device(self, host, slots, views, block_ids) -> None:
        if block_ids:
            self.ranks.send("to_device", (list(slots), list(block_ids)))
            self._unsynced = True
        self.copier.to_device(host, slots, views, block_ids)

    def wait_for_copies(self) -> None:
        self.copier.wait_for_copies()

    def synchronize(self) -> None:
        """Every copy done, on every rank: before this process reads or writes their slots or blocks itself (the
        disk tier, another worker reading the pool's parts)."""
        self.copier.synchronize()
        if self._unsynced:
            self.ranks.sync()
            self._unsynced = False


# -- ranks 1.. ---------------------------------------------------------------------------------------------


def _rank_main(plans, path: Path, model_config: ModelConfig, config: EngineConfig, rank: int, port: int,
               threads: int) -> None:  # fmt: skip
    """A rank's process: join the group, load this rank's part, then run the plans read from ``plans`` until
    told to stop, or until they end (the engine's process is gone)."""
    device = config.torch_device()
    if device.type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(threads)
    dtype = config.torch_dtype(device)
    size = config.tensor_parallel_size
    group = _join(rank, size, port, device, config.tensor_parallel_timeout_s)
    shard = Shard.of(model_config, rank, size)
    with torch.inference_mode():
        model = load_model(path, model_config, dtype, device, shard, group)
        if device.type == "cpu":
            pack_for_onednn(model)
        kv = None
        freeze_startup_heap()  # (engine.heap: a full collection would stall this rank, and every rank waiting on it)
        keep_freed_memory()
        while True:
            try:
                op, payload = pickle.load(plans)
            except EOFError:
                return  # the engine is gone
            if op == "stop":
                return
            if op == "allocate":
                num_blocks, paths = payload
                spec = kv_spec(shard.config(), config, dtype)
                kv = map_pool_file(spec, num_blocks, paths[rank - 1]) if paths else KVCache(spec, num_blocks, device)
                if device.type == "cuda":  # rank 0 opens our part through CUDA IPC (``Ranks.allocate``)
                    group.gather(handle_to_tensor(export_cuda_ipc(kv), device))
                else:
                    group.barrier()
            elif op == "host_tier":
                num_slots, paths = payload
                mapped = map_pool_file(kv.spec, num_slots, paths[rank - 1]) if paths else None
                host = HostTier(kv.spec, num_slots, pin_memory=device.type == "cuda", cache=mapped)
                copier = BlockCopier(device)
                group.barrier()
            elif op == "sync":
                copier.synchronize()
                group.barrier()
            elif op == "to_host":  # (then ordered before this rank's next step, as the engine orders rank 0's)
                copier.to_host(kv.layers, payload[0], host.views, payload[1])
                copier.wait_for_copies()
            elif op == "to_device":
                copier.to_device(host.views, payload[0], kv.layers, payload[1])
                copier.wait_for_copies()
            elif op == "forward":
                input_ids, positions, meta = (from_host(v, device) for v in payload)
                model(input_ids, positions, kv.layers, meta)
            elif op == "logits":
                gather_logits(group, model.compute_logits(from_host(payload, device)), shard)
            elif op == "decode_steps":  # (engine.tensor_parallel_model: CUDA graphs captured in step with rank 0)
                decode = rank_decode_steps(model, shard, kv.layers, *payload, device)
            elif op == "decode":
                run_rank_step(decode, *payload)



_RANK_MAIN = ("import pickle, sys; from engine.tensor_parallel_ranks import _rank_main; "
              "_rank_main(sys.stdin.buffer, *pickle.load(sys.stdin.buffer))")  # fmt: skip
