# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow test-gpu bench-deps venv clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch is pinned to the CPU wheel (a plain `torch` may pull a multi-GB CUDA build).
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/lazytrain demo

test: $(STAMP)
	$(BIN)/python -m pytest

test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow

test-gpu: $(STAMP)
	$(BIN)/python -m pytest -m gpu

# Peers for the benchmarks (bitsandbytes, torchao, DeepSpeed) and DeepSpeed's NVMe op dependency.
bench-deps: $(STAMP)
	$(BIN)/pip install -q -e '.[bench]'
	command -v apt-get >/dev/null && { dpkg -s libaio-dev >/dev/null 2>&1 || \
	  (apt-get update -qq && apt-get install -y -qq libaio-dev); } || \
	  echo "install libaio-dev (Debian/Ubuntu) for DeepSpeed NVMe offload"

clean:
	rm -rf $(VENV) outputs multirun
