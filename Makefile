# One entry point for set-up, build, tests and benchmarks. Every target sets up what it needs:
# system packages through apt when run as root, a virtualenv in .venv, the build.
#   make demo   - the main job: torchrun training, 4 workers, one 5x straggler, gloo vs ripples
#   make test   - everything CI runs: C unit tests, the same under ASan+UBSan, pytest, and the
#                 wheel check
#   make build  - (re)build the package into .venv (the extension when its sources changed)
#   make wheel  - the binary wheel, libzmq bundled: wheelhouse/ripples_pg-*.whl
#   make wheel-check - that wheel installed into a fresh venv holding only torch: smoke test
#   make bench, make bench-train - collectives vs gloo; training under stragglers (~1 h)
#   make gpu-prepare - fetch what the bare GPU machine lacks into .gpu/ (scripts/gpu-prepare.sh)
#   make gpu-check-dry - the GPU check's CPU dry run (scripts/gpu-check.sh --cpu-dry-run)
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
JOBS ?= 2
PYTEST_ARGS ?=

.PHONY: all sysdeps venv build ctest asan pytest test wheel wheel-check demo bench bench-train clean \
	gpu-prepare gpu-check-dry

all: build

sysdeps:
	@bash scripts/sysdeps.sh

$(VENV)/.deps: requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q -r requirements-dev.txt
	touch $@

venv: sysdeps $(VENV)/.deps

# The extension is rebuilt only when what it is built from changed (the editable install
# picks up Python files as they are): `make pytest` after a Python-only change starts at once.
BUILD_INPUTS := $(shell find csrc coordinator shim -type f \( -name '*.c' -o -name '*.h' -o \
	-name '*.cpp' -o -name '*.hpp' -o -name CMakeLists.txt \)) CMakeLists.txt setup.py \
	pyproject.toml

$(VENV)/.built: $(VENV)/.deps $(BUILD_INPUTS)
	$(PIP) install -q --no-build-isolation -e .
	touch $@

build: venv
	@ls ripples_pg/_C*.so >/dev/null 2>&1 || rm -f $(VENV)/.built
	@$(MAKE) --no-print-directory $(VENV)/.built

ctest: sysdeps
	cmake -S . -B build/ctest -DCMAKE_BUILD_TYPE=RelWithDebInfo
	cmake --build build/ctest --parallel $(JOBS)
	cd build/ctest && ctest --output-on-failure

asan: sysdeps
	cmake -S . -B build/asan -DCMAKE_BUILD_TYPE=Debug -DRIPPLES_SANITIZE=address,undefined
	cmake --build build/asan --parallel $(JOBS)
	cd build/asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ctest --output-on-failure

pytest: build
	$(PY) -m pytest tests $(PYTEST_ARGS)

# Builds the wheel in its own directory (build/wheel), so it never disturbs the dev build.
wheel: venv
	PYTHON=$(abspath $(PY)) MAX_JOBS=$(JOBS) bash scripts/wheel.sh

wheel-check: venv
	PYTHON=$(abspath $(PY)) MAX_JOBS=$(JOBS) bash scripts/wheel-check.sh

test: ctest asan pytest wheel-check

demo: build
	PYTHON=$(abspath $(PY)) bash scripts/demo.sh

bench: build
	$(PY) benchmarks/collectives.py --out benchmarks/results

bench-train: build
	$(PY) benchmarks/train.py --out benchmarks/results/train

gpu-prepare:
	PYTHON=$(PYTHON) bash scripts/gpu-prepare.sh

gpu-check-dry: build
	PYTHON=$(abspath $(PY)) bash scripts/gpu-check.sh --cpu-dry-run

clean:
	rm -rf build dist wheelhouse $(VENV) *.egg-info ripples_pg/*.so ripples_pg/_build_info.py
