"""Where GRPO's actors live (coder/rl/actor_hosts.py): the CPUs a local Ray is started with."""
from configs import base
from coder.rl import actor_hosts


def test_a_local_ray_has_cpus_for_every_env_pool_of_the_run(monkeypatch):
    """The CPUs a local Ray is started with: the actors' processes, the driver, and with Ray env
    workers each actor's pool and the learner's agent-eval pool (the 4-process GRPO test's eval
    pool waited for a CPU that never came when the eval pool was left out)."""
    monkeypatch.setattr(actor_hosts.os, "cpu_count", lambda: 1)
    cfg = base.get_config()
    cfg.rl.update(dict(env_workers=2, group_size=4, tasks_per_step=2))
    cfg.env.workers_backend = "local"
    assert actor_hosts.local_ray_cpus(cfg, 1, 2) == 2 + 1
    cfg.env.workers_backend = "ray"
    assert actor_hosts.local_ray_cpus(cfg, 1, 2) == 2 + 1 + 2 + 2
    assert actor_hosts.local_ray_cpus(cfg, 0, 1) == 0 + 1 + 2 + 2  # the actor in the learner's process
    cfg.env.ray_num_cpus_per_worker = 0.5
    cfg.rl.env_workers = 0  # one per rollout of the actor's groups (2 x 4), the eval's up to 16
    assert actor_hosts.local_ray_cpus(cfg, 3, 1) == 3 + 1 + (3 * 8 + 16) // 2
