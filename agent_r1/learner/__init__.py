"""Learner layer: Megatron-Core models (policy, critic) built by megatron_bridge, on GPU or CPU."""
