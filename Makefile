# `make demo` and `make test` bootstrap .venv themselves on a fresh machine.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
DEMO_DIR ?= runs/demo

.PHONY: demo test test-unit docs-cli bench bench-runtime bench-peers bench-scaling bench-models bench-checkpoint bench-preprocess bench-storage bench-parity bench-single adversarial gpu-check gpu-wheels bench-network clean

$(BIN)/bagpipe: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

demo: $(BIN)/bagpipe
	$(BIN)/bagpipe synth --out $(DEMO_DIR)/data --rows 500000 --test-rows 50000 --seed 1 --max-rows-per-table 20000
	$(BIN)/bagpipe train --config configs/demo.toml --data $(DEMO_DIR)/data --run-dir $(DEMO_DIR)/run --overwrite

# Two workers (pytest-xdist), each with its own fork server: jobs wait on each other's processes far more than they
# compute, so two at once keep both cores busy (docs/history/benchmarks.md, "The test suite").
# OMP_WAIT_POLICY=PASSIVE: idle OpenMP threads sleep rather than spin while others need the cores (tests/conftest.py)
test: $(BIN)/bagpipe
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -n 2 --durations=15

# The tests that start no process (no job, no CLI command in a child): tests/unit, a fast tier while working;
# `make test` runs tests/integration too. A test outside tests/integration that starts a process fails
# (tests/conftest.py).
test-unit: $(BIN)/bagpipe
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -n 2 tests/unit --durations=10

bench: $(BIN)/bagpipe
	$(BIN)/python benchmarks/bench_reference.py

bench-runtime: $(BIN)/bagpipe
	$(BIN)/python benchmarks/bench_runtime.py

# LINK=RATE (e.g. 1gbit): over a loopback shaped to that rate, in a network namespace of its own (root)
bench-peers: $(BIN)/bagpipe
	$(BIN)/python benchmarks/bench_peers.py --repeats 5 $(if $(LINK),--link $(LINK))

bench-network: $(BIN)/bagpipe
	$(BIN)/python benchmarks/bench_network.py --out runs/bench_network/runs.jsonl

bench-scaling: $(BIN)/bagpipe
	$(BIN)/python benchmarks/bench_scaling.py

bench-models: $(BIN)/bagpipe
	$(BIN)/python benchmarks/bench_models.py --work-dir runs/bench_models --out runs/bench_models/result.json

bench-checkpoint: $(BIN)/bagpipe
	$(BIN)/python benchmarks/bench_checkpoint.py --work-dir runs/bench_checkpoint --out runs/bench_checkpoint/result.json

bench-preprocess: $(BIN)/bagpipe
	$(BIN)/python benchmarks/bench_preprocess.py --work-dir runs/bench_preprocess --out runs/bench_preprocess/result.json

bench-storage: $(BIN)/bagpipe
	$(BIN)/python benchmarks/bench_storage.py --work-dir runs/bench_storage --out runs/bench_storage/result.json

bench-parity: $(BIN)/bagpipe
	$(BIN)/python benchmarks/bench_parity.py --work-dir runs/bench_parity --out runs/bench_parity/result.json

bench-single: $(BIN)/bagpipe
	$(BIN)/python benchmarks/bench_single.py --work-dir runs/bench_single --out runs/bench_single/result.json
	$(BIN)/python benchmarks/bench_single.py --hit-rates 2000 --out runs/bench_single/hit_rates.json

adversarial: $(BIN)/bagpipe
	$(BIN)/python benchmarks/adversarial_runs.py --work-dir runs/adversarial --out runs/adversarial/result.json

# On a machine with a GPU and its own torch (no network, no venv): the project from its source, a report in $(OUT).
# Dependencies it lacks are installed from $(GPU_WHEELS) if there (made here by `make gpu-wheels`, carried over).
GPU_PYTHON ?= python3
GPU_WHEELS ?= .gpu-wheels
GPU_DEPS := tqdm xxhash orjson pyarrow pytest pytest-xdist py-spy
OUT ?= runs/gpu_check
gpu-check:
	@$(GPU_PYTHON) -c "import tqdm, xxhash, orjson, pyarrow, pytest, xdist, shutil, sys, pathlib; \
	  assert shutil.which('py-spy') or (pathlib.Path(sys.executable).parent / 'py-spy').exists()" 2>/dev/null || \
	  $(GPU_PYTHON) -m pip install -q --no-index --find-links $(GPU_WHEELS) $(GPU_DEPS) || \
	  echo "gpu-check: could not install $(GPU_DEPS) from $(GPU_WHEELS) (make gpu-wheels); the report says what is missing"
	PYTHONPATH=src $(GPU_PYTHON) benchmarks/gpu_check.py --out $(OUT) $(GPU_CHECK_ARGS)

# The wheels gpu-check needs besides torch, for the GPU machine's Python (3.12, x86-64 Linux): about 56 MB.
gpu-wheels: $(BIN)/bagpipe
	$(BIN)/python -m pip download -q --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d $(GPU_WHEELS) $(GPU_DEPS)

clean:
	rm -rf $(VENV) .venv-torchrec runs

# docs/cli.md: every command's --help, generated from the parser (tests/unit/project/test_clidoc.py says when it is
# stale)
docs-cli: $(BIN)/bagpipe
	$(BIN)/python -m bagpipe.clidoc docs/cli.md
