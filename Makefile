# The two commands of the README: `make demo` and `make test`. Everything else is a step of those.
PY ?= python3

.PHONY: setup setup-vllm broker test test-fast demo bench down

setup:            ## Python packages (pinned in pyproject.toml) and the Kafka broker jars
	$(PY) -m pip install -q -e ".[dev]"
	@# faust-streaming pins click<8.4, which transformers' hub client cannot use: install it beside, without deps.
	$(PY) -m pip install -q --no-deps faust-streaming==0.15.3 mode-streaming==0.7.1 aiokafka==0.14.0 \
		aiohttp-cors==0.8.1 croniter==5.0.1 intervaltree==3.2.1 terminaltables==3.1.10 venusian==3.1.0 \
		mypy_extensions==1.1.0
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
