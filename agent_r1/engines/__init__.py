"""The engines behind the rollout protocol, one module or package each: ``embedded`` (this
project's CPU/GPU engine behind SGLang's HTTP API), ``sglang`` and ``vllm`` (upstream servers as a
run's role), ``hf`` (the transformers reference). What each one is — its config, how it is served,
its API adapter, its weight transport, whether it needs a GPU — is its entry in
``agent_r1.engine_spec``."""
