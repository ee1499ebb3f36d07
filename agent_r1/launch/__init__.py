"""Launching a run: pre-flight checks, the roles a run starts (``roles.ROLES``), the local launcher,
the Slurm job and sweeps, and the memory plan of a GPU run. Built on ``agent_r1.train``; nothing in
``train`` imports it."""
