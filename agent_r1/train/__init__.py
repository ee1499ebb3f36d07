"""The trainer: config, run directory, roles (learner / server / worker), the RL loop, launchers."""
