"""Task sources: where tasks come from (SWE-bench, R2E-Gym, Harbor, package releases, mutants, repositories), each read by `python -m coder.env.make_tasks --source NAME`."""
