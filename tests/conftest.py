"""Shared fixtures: the real bundled model, Hugging Face's reference outputs and the engine's test prompts.

Exactness, in every test: assert bit-equality of floating-point results only where the product guarantees it:
the same kernel on the same shapes in the same order, or a copy, a transfer, a swap round trip, a checksum.
Values that two schedules produce (cached against recomputed, chunked against whole, batched against alone,
remote against local prefill) differ in summation order, and which BLAS kernel runs depends on the CPU and the
shapes. There a test checks the mechanism (what was read, from where, the counters), the greedy tokens, and the
values within a stated tolerance whose comment says why it holds (``engine_testing.KV_TOLERANCE``).
``make test-isa`` runs the exactness-sensitive modules under lower instruction sets to catch the difference.
"""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")  # tests start processes too: see kvserve/launcher
# kvserve up compiles its CPU decode workers' one-user steps (``compile_decode``): test clusters start eagerly, as
# their tokens are checked against the eager paths; tests/service/test_compiled_decode.py checks the compiled one
os.environ.setdefault("KVSERVE_COMPILE_DECODE", "false")
# decode workers prefill short prompts themselves (``--disagg-min-uncached-tokens``), and any prompt while the
# prefill workers' queues are long (``--disagg-max-prefill-queue``): the suite's clusters hand every prompt off,
# to test the hand-off; tests/cluster/test_disagg_cluster.py tests both rules' defaults
os.environ.setdefault("KVSERVE_DISAGG_MIN_UNCACHED_TOKENS", "0")
os.environ.setdefault("KVSERVE_DISAGG_MAX_PREFILL_QUEUE", "0")

import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest_plugins = ["startup_count"]  # the run's summary counts cluster and worker start-ups

TESTS = Path(__file__).resolve().parent
KINDS = ("unit", "engine", "kernels", "service", "cluster", "deploy")  # a directory each, and the marker of its tests
# ``make test`` runs two pytest-xdist workers (``-n 2 --dist loadgroup``), one per group
# (``pytest_xdist_make_scheduler`` below). The tiers that start servers (service: gRPC servers and an embedded
# Redis; cluster: worker processes) bind ports and name Redis servers, shared memory and network namespaces, so
# they run one at a time, as without xdist; the rest (unit, engine, deploy) run beside them. A service module
# that starts no server, only a compiler (``NO_SERVERS``), runs beside them too: the servers' group took 641 s
# of a 661 s run, the other 428 s.
GROUPS = {"unit": "no-servers", "engine": "no-servers", "kernels": "no-servers", "deploy": "no-servers",
          "service": "servers", "cluster": "servers"}  # fmt: skip
NO_SERVERS = {"tests/service/test_compiled_decode.py"}  # inductor's compiler, one engine in the process
assert GROUPS.keys() == set(KINDS), "every kind of test runs in a group"

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))  # half the cores each: no OpenMP pool shares a core


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test gets the marker of its directory (``-m unit``, ``-m cluster``...); and the one CUDA skip: every
    test marked ``gpu`` is skipped on a machine without a CUDA device."""
    for item in items:
        kind = item.path.resolve().relative_to(TESTS).parts[0]
        if kind not in KINDS:
            raise pytest.UsageError(f"{item.nodeid}: a test lives in one of tests/{{{','.join(KINDS)}}}/")
        item.add_marker(kind)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu: needs a CUDA device (run it on the GPU machine: scripts/gpu_check.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadgroup`` by ``GROUPS``: each group is one unit of work, run in order on one worker. (pytest-xdist's
    own ``xdist_group`` markers name the group in a node id suffix, which pytest 9.2's node ids no longer carry.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "no-servers" if nodeid.split("::")[0] in NO_SERVERS else GROUPS[nodeid.split("/")[1]]

    return ByGroup(config, log)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Caches a first use builds with a process, built here before any test runs, so that a unit or engine test
    starts no process on a fresh machine: matplotlib's font cache (``fc-list``, on its first import: a test that
    plots, ``kvserve bench ... --plot``) and the CPU's C decode attention (``cc``, when an engine starts)."""
    import matplotlib.font_manager  # noqa: F401

    from engine.model_runner import prepare_cpu_decode

    prepare_cpu_decode()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """A unit or engine test starts no process: not in its body, nor in a fixture it sets up (a Redis server, a
    worker). Starting one raises, naming the test, so a test that needs one moves to service/ or cluster/."""
    kind = next((k for k in ("unit", "engine") if item.get_closest_marker(k) is not None), None)
    if kind is None or item.get_closest_marker("gpu") is not None:  # (Triton on a GPU compiles with ptxas, a process)
        return (yield)

    def refuse(*args, **kwargs):
        raise AssertionError(f"{item.nodeid} is a{'n' if kind == 'engine' else ''} {kind} test and started a "
                             "process: it belongs in tests/service/ (in-process gRPC, embedded Redis) or "
                             "tests/cluster/ (worker processes)")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "_execute_child", refuse)
        patch.setattr(os, "fork", refuse)
        patch.setattr(os, "posix_spawn", refuse)
        return (yield)


from engine_testing import BLOCK_SIZE, NUM_NEW_TOKENS  # noqa: E402

_TEXT = (
    "The history of computing is a story of abstraction layered on abstraction. Early machines were programmed "
    "by rewiring panels; then came stored programs, assemblers, compilers and operating systems. Each layer let "
    "people think about bigger problems while the layer below handled the details. Networks joined the machines "
    "together, and the web turned them into a library anyone could read. Today large language models answer "
    "questions, write code and translate between languages, and serving them efficiently has become an "
    "engineering discipline of its own: batching requests, caching attention keys and values in pages, and "
    "moving those pages between machines without copying them more than necessary. A good serving system keeps "
    "the expensive accelerator busy, never wastes memory on padding, and returns the first token quickly. "
    "Recipes for bread begin with flour, water, salt and yeast; the baker's skill lies in time and temperature. "
    "Mountains rise where plates collide, and rivers carve valleys over millions of years."
)


@pytest.fixture(scope="session")
def model_dir():
    from engine.bundled import prepare_default_model

    return prepare_default_model()


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from engine.tokenizer import Tokenizer

    return Tokenizer(model_dir)


@pytest.fixture(scope="session")
def engine_prompts(tokenizer) -> list[list[int]]:
    """Eight token-id prompts: shorter than a block, exact multiples of the block size, and many blocks long."""
    ids = tokenizer.encode(_TEXT)
    chat = tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    )
    lengths_and_offsets = [(5, 0), (BLOCK_SIZE, 3), (2 * BLOCK_SIZE, 40), (BLOCK_SIZE + 1, 90), (47, 20), (100, 7),
                           (170, 11)]  # fmt: skip
    prompts = [ids[off : off + n] for n, off in lengths_and_offsets]
    prompts.append(chat)
    assert [len(p) for p in prompts[:7]] == [n for n, _ in lengths_and_offsets]
    return prompts


@pytest.fixture(scope="session")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # always produce exactly NUM_NEW_TOKENS, like ignore_eos
    model.config.eos_token_id = None
    return model


@pytest.fixture(scope="session")
def hf_greedy(hf_model, engine_prompts) -> list[list[int]]:
    """Transformers' greedy continuation of each prompt (one at a time, no padding)."""
    outputs = []
    with torch.inference_mode():
        for prompt in engine_prompts:
            ids = torch.tensor([prompt])
            out = hf_model.generate(ids, max_new_tokens=NUM_NEW_TOKENS, do_sample=False, pad_token_id=0)
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


@pytest.fixture(scope="session")
def llm():
    from engine import LLM

    return LLM("default", block_size=BLOCK_SIZE, num_blocks=512)


@pytest.fixture(scope="session")
def random_qwen2_dir(tmp_path_factory):
    """Qwen2-0.5B's width, heads, vocabulary, RoPE theta, q/k/v biases and tied embeddings, in 2 layers (fp32)."""
    from kvserve.testing.random_model import write_random_model

    return write_random_model(tmp_path_factory.mktemp("qwen2"), "qwen2-0.5b", num_layers=2, dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """``qwen2-tiny`` (2 layers, width 64, 1,024 tokens, fp32, random weights drawn wide enough that greedy
    answers vary): milliseconds per step, for cluster tests of plumbing (``cluster_utils.tiny_engine_argv``)."""
    from kvserve.testing.random_model import write_random_model

    return write_random_model(tmp_path_factory.mktemp("qwen2-tiny"), "qwen2-tiny", dtype=torch.float32,
                              overrides={"initializer_range": 0.1})  # fmt: skip


@pytest.fixture(scope="module")
def redis_server():
    """A real Redis server (the embedded one ``kvserve up`` runs) for one test module."""
    from kvserve.launcher.redis_server import EmbeddedRedis

    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def raw(redis_server):
    """A plain client of ``redis_server`` on an emptied database: the view of anyone who can reach Redis."""
    import redis

    with redis.Redis.from_url(redis_server.url, decode_responses=True) as client:
        client.flushdb()
        yield client
