# minitrain — the two commands of the course (see README.md):
#   make lab    set up on first use, then open the course in JupyterLab
#   make test   set up on first use, then run every check CI runs
# Both create .venv with the pinned requirements the first time (a few minutes).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
READY  := $(VENV)/.ready
PYTEST := $(BIN)/python -m pytest -p no:cacheprovider
export OMP_NUM_THREADS ?= 1

.PHONY: lab test test-gpu sweep lint unit grade-verify nbval browser lecture slides notebooks exercises mutants clean

$(READY): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $(READY)

# learners work in their own copies (my_notebooks/, my_exercises/: git-ignored, never
# overwritten, new chapters added); instructors: `make lab NOTEBOOKS=notebooks`.
# localhost only, token auth kept; --allow-root only where you are root (containers, CI)
NOTEBOOKS ?= my_notebooks
lab: $(READY)
	$(BIN)/python -m minitrain.exercises start
	$(BIN)/jupyter lab --notebook-dir=$(NOTEBOOKS) --ServerApp.ip=127.0.0.1 \
		$(if $(filter 0,$(shell id -u)),--allow-root)

# After lint, two lanes at once (tests/run_checks.py: a line per step as it ends, its log in
# test-logs/, the times at the end): the unit tests | the graded tests, nbval, the browser.
# Each step is a target of its own here (`make unit`, `make nbval`, ...).
TEST_LANES ?= "unit" "grade-verify nbval browser"
test: lint
	$(BIN)/python tests/run_checks.py $(TEST_LANES)
	@echo "make test: every check passed"

# the same checks on a multi-GPU machine (.github/workflows/gpu.yml runs it), after tests/gpu/:
# every technique's parameters, gradients, optimizer state and buffers on cuda:rank, NCCL
# kernels in the profiler, bf16 Triton FlashAttention against SDPA, each notebook under nbval
# with a GPU per rank (`make unit` leaves tests/gpu out: `make test-gpu` runs it once, first).
# Launches with a GPU per rank use NCCL for CUDA tensors (minitrain.runtime.rank.default_backend).
# Without 2 GPUs it refuses, unless GPU_BACKEND forces a backend:
# `make test-gpu GPU_BACKEND=cpu:gloo` runs `make test` (not tests/gpu) on a CPU machine.
GPU_BACKEND ?=
test-gpu: $(READY)
	@$(BIN)/python -c "import sys, torch; n = torch.cuda.device_count(); print('GPUs:', n, '| MINITRAIN_BACKEND:', '$(GPU_BACKEND)' or 'default (NCCL for CUDA tensors)'); sys.exit(0 if n >= 2 or '$(GPU_BACKEND)' else 'make test-gpu: needs 2 or more GPUs, this machine has ' + str(n) + ' (GPU_BACKEND=cpu:gloo runs make test on a CPU)')"
	$(if $(GPU_BACKEND),,$(PYTEST) tests/gpu -q -rs)
	$(if $(GPU_BACKEND),MINITRAIN_BACKEND=$(GPU_BACKEND)) $(MAKE) test

lint: $(READY)
	$(BIN)/ruff check minitrain tests exercises solutions
	$(BIN)/python -m minitrain.exercises check

unit: $(READY)
	$(PYTEST) tests --ignore=tests/grading --ignore=tests/browser --ignore=tests/gpu -q -rs

# every layout the planner proposes on 4 and 8 devices (make test runs a pairwise-covering
# subset of them: tests/test_planner_layouts.py), about 10 minutes on two cores
sweep: $(READY)
	MINITRAIN_SWEEP=full $(PYTEST) tests/test_planner_layouts.py -q --timeout=1800

grade-verify: $(READY)
	$(BIN)/python -m minitrain.grade --verify

# nbval executes every notebook with one thread and compares each cell's outputs with the
# committed ones; the browser pass below executes them again with two threads and compares
# the same way (tests/browser/notebook_outputs.py), so an output that depends on the thread
# count (a reduction order, a BLAS kernel) fails here instead of on a learner's laptop
NBVAL := $(PYTEST) --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg
nbval: $(READY)
	OMP_NUM_THREADS=1 $(NBVAL) notebooks -q

# JupyterLab in headless Chromium (tests/browser/), part of make test. Needs a Chromium
# (Debian: apt-get install chromium; .ci/run installs it); skipped, saying so, without one.
# Every notebook: Run All with two threads (BROWSER_THREADS), no error shown, every output nbval
# compares equal to the committed one, each widget's controls moved and its view changed;
# the check itself (a notebook of broken widgets must be reported) and lecture mode. Two
# pytest-xdist workers, each its own JupyterLab and Chromium page: about 7 minutes on 2 cores in make test,
# bounded by BROWSER_TIME_LIMIT (25 minutes: in make test it shares the cores with the unit
# tests, and a loaded machine once took it past 15; the pass fails, saying so, when it runs out).
# OMP_WAIT_POLICY=PASSIVE: an idle OpenMP thread sleeps instead of spinning for the next op
# (the same threads, the same numbers; notebooks 00 + 02 at 2 threads: 44 -> 40 CPU-s alone,
# more while the unit tests share the cores).
#   make browser BROWSER_NOTEBOOKS=05_,06_    only the notebooks whose names start so
CHROMIUM := $(or $(MINITRAIN_CHROMIUM),$(shell command -v chromium || command -v chromium-browser))
BROWSER_NOTEBOOKS ?=
BROWSER_WORKERS ?= 2
BROWSER_TIME_LIMIT ?= 1500
BROWSER_THREADS ?= 2
browser: $(READY)
	@if [ -z "$(CHROMIUM)" ]; then \
		echo "browser tests SKIPPED: no Chromium found (apt-get install chromium, or set MINITRAIN_CHROMIUM)"; \
	else \
		for attempt in 1 2; do \
			OMP_NUM_THREADS=$(BROWSER_THREADS) OMP_WAIT_POLICY=PASSIVE MINITRAIN_CHROMIUM=$(CHROMIUM) \
				MINITRAIN_BROWSER_NOTEBOOKS=$(BROWSER_NOTEBOOKS) \
				timeout -k 15 $(BROWSER_TIME_LIMIT) $(PYTEST) tests/browser -q -rs -n $(BROWSER_WORKERS) \
				&& exit 0; \
			rc=$$?; \
			if [ $$rc -eq 124 ]; then echo "browser tests FAILED: the pass took longer than" \
				"its bound of $(BROWSER_TIME_LIMIT) s (make browser BROWSER_TIME_LIMIT=... to change it)"; exit $$rc; fi; \
			[ $$attempt -eq 2 ] || echo "browser tests: a check failed; the pass runs once more" \
				"(a known flake: a widget JupyterLab left off screen, docs/design.md)"; \
		done; exit $$rc; \
	fi

# instructors: a notebook as slides with live widgets, e.g. `make lecture NB=04` (Voilà)
lecture: $(READY)
	@test -n "$(NB)" || { echo "usage: make lecture NB=04"; exit 2; }
	$(BIN)/python -m minitrain.course.notebooks lecture $(NB)

# authors: mark every notebook up for lecture mode (idempotent; run after adding a notebook)
slides: $(READY)
	$(BIN)/python -m minitrain.course.notebooks slides

# authors: re-execute the notebooks in place after changing them, then commit
notebooks: $(READY)
	$(BIN)/python -m minitrain.course.notebooks run

# authors: apply each named known bug (tests/mutations.py) to a copy; its tests must fail.
# Not part of `make test`: it runs the named tests once per mutation.
mutants: $(READY)
	$(BIN)/python tests/mutations.py

# authors: regenerate exercises/ and solutions/ from the markers in minitrain/
exercises: $(READY)
	$(BIN)/python -m minitrain.exercises build

clean:
	rm -rf $(VENV)
