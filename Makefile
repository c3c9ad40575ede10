# The two commands of the README: `make demo` and `make test`. Everything else is a step of those.
PY ?= python3

.PHONY: setup setup-vllm broker test test-fast demo bench down

setup:            ## Python packages (pinned in pyproject.toml) and the Kafka broker jars
	$(PY) -m pip install -q -e ".[dev]"
	bash infra/kafka/fetch.sh

setup-vllm: setup ## vLLM's CPU build (optional: rollout falls back to transformers without it)
	bash infra/install_vllm.sh

broker: setup
	rlstream up

test: setup-vllm broker ## every test, slow ones included, against the real broker and chDB
	$(PY) -m pytest -q

test-fast: setup  ## unit tests only
	$(PY) -m pytest -q tests/unit

demo: setup-vllm  ## the whole loop on this machine until the tiny model learns
	rlstream demo

bench: setup-vllm broker
	bash benchmarks/run_all.sh

down:
	rlstream down
