"""Moved to coder.rl.trajectory (and coder.rl.agent): only until coder/rl/learner.py imports it."""
from coder.rl.trajectory import Generation, Rollout, to_batch  # noqa: F401
