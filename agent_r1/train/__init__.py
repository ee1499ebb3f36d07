"""Training: the config, the run directory, the rollout tasks, the worker, the coordinator, the
learner and the RL loop. Starting those processes (launchers, Slurm, roles, pre-flight checks,
the memory plan) is ``agent_r1.launch``'s, which imports this package and never the reverse."""
