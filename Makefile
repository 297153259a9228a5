# loraplane: `make demo` runs the main job end to end, `make test` runs the suite.
# Both create .venv when it is missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: venv kernels postgres test test-fast test-quick demo bench up clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# the native LoRA kernel (computed/backend/kernels): built once per source, compiler and CPU; where it
# cannot be built, the replica says why and uses the XLA window loop instead
kernels: $(STAMP)
	-$(BIN)/python -m computed.backend.kernels

# the PostgreSQL server the tests start themselves: installed only when missing (.ci/postgres)
postgres:
	@.ci/postgres

# two pytest-xdist workers, one test module per worker at a time (module fixtures and the order of a
# module's tests stay as written), modules in the order tests/conftest.py gives them (slow ones
# first) rather than by test count; most tests wait on the processes they start (docs/testing.md)
PYTEST := $(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder

test: kernels postgres
	$(BIN)/python -m mypy
	$(PYTEST) --durations=25 tests

test-fast: kernels postgres
	$(PYTEST) -m "not slow" tests

# the edit loop (docs/testing.md): the unit tests, the parity checks on the smallest checkpoint
# (test_model_parity's `tied-llama3-mha` shape, every backend, and its kernel checks; `-k "not
# example"` leaves out the example-shape cases) and one end-to-end run of statesvc and two replicas
QUICK := tests/unit tests/parity/test_model_parity.py \
	tests/integration/test_replica.py::test_two_replicas_agree_with_statesvc_and_the_files
test-quick: kernels postgres
	$(PYTEST) -m "not slow" -k "not example" $(QUICK)

# FAMILY=qwen2 (or any `loractl make-example --family`): the demo on that family's example
demo: kernels
	$(BIN)/python -m statesvc.tools.demo $(if $(FAMILY),--family $(FAMILY))

# every benchmark, then benchmarks/results/latest.json, the plots and the README tables
bench: kernels
	$(BIN)/python -m benchmarks $(if $(ISA),--isa $(ISA))

clean:
	rm -rf $(VENV) var bench-results .pytest_cache build/test-xla-cache

# statesvc and one replica on the example model, in the foreground; Ctrl-C stops both.
up: kernels
	$(BIN)/python -m statesvc.tools.up
