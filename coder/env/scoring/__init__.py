"""Scoring: a rollout's workspace tested and graded (score.py), by the runners' own report formats (runners.py) and SWE-bench's resolution rule (grading.py), verdicts shared per workspace."""
