"""Algorithms: pure tensor functions (rewards, advantage estimators, policy losses).

Inputs are flat streams (steps or tokens) with segment ids; reductions across ranks go through an
explicit ``Reducer``. Nothing here does I/O or knows about processes.
"""
