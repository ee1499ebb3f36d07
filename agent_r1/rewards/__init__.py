"""Rule rewards, picked by a data row's ``reward_model.style``."""

from agent_r1.rewards import qa, table  # noqa: F401  (register "qa_em", "wtq")
from agent_r1.rewards.answer import extract_answer, extract_boxed, normalize_number
from agent_r1.rewards.rule import REWARDS, RewardResult, compute_reward

__all__ = ["REWARDS", "RewardResult", "compute_reward", "extract_answer", "extract_boxed", "normalize_number"]
