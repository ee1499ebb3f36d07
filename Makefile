# Two commands: `make run` (the main job) and `make test` (the whole suite). Both install first.
VENV  ?= .venv
PY    := $(VENV)/bin/python
TINY  ?= artifacts/tiny-qwen3
EPISODES ?= 16

.PHONY: install run test lint format tiny-model clean

install:
	@bash tools/install.sh

tiny-model: install
	@test -f $(TINY)/config.json || $(PY) tools/make_tiny_model.py --recipe arithmetic_tool --arch qwen3 --out $(TINY)

# For now: the quickstart agent loop (untrained tiny model, greedy). Training replaces it.
run: tiny-model
	$(VENV)/bin/agent-r1 rollout --model $(TINY) --recipe arithmetic_tool --episodes $(EPISODES) --out runs/quickstart/records.arrow

test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q tests

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format .

clean:
	rm -rf artifacts runs .pytest_cache
