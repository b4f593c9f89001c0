#!/usr/bin/env bash
# Download, into .whl/, the Python 3.12 x86-64 wheels that scripts/gpu_check.sh needs and the GPU machine lacks
# (its image has torch, triton, transformers, grpcio, protobuf, safetensors, tokenizers, xxhash and pytest).
# Run it here in the repo root before the device call, then carry .whl (see .library/device/README.md).
set -euo pipefail
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl \
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
    typing-extensions==4.16.0 pydantic-settings==2.16.3 python-dotenv==1.2.4
ls .whl
