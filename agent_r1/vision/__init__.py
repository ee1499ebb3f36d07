"""Images and vision-model geometry, below every other layer: the agent layer renders images into
prompts, records store them, the rollout engine and the learner embed them."""
