"""HF <-> Megatron-Core model bridge (Llama, Qwen2, Qwen3): config and weight-name maps.

Empty until the learner issue lands; the package exists so the layout of DESIGN §2 is visible.
"""
