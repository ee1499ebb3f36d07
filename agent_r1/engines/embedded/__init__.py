"""The embedded rollout engine (``agent-r1 serve``): continuous batching on a slot KV cache
(``engine``), the model that reads and writes the slots (``slot_model``, ``attention``), the
sampler (``sampling``), the vision tower (``vision``) and SGLang's HTTP API in front (``server``)."""
