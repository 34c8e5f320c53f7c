"""Where stage grpo's actors run (coder/rl/topology.py): each combination of the deployment keys
is one Topology kind, scatter follows from it and the learner's process count, each process's
driver walks its share of the tasks, and keys that cannot work together stop at start-up.
The deployments themselves run end to end in tests/rl/test_grpo_actors.py (in-process, a Ray
actor), test_grpo_colocated.py, test_actor_group.py and tests/test_multiprocess.py."""
import jax.numpy as jnp
import pytest

from coder.rl.topology import Kind, Topology


def topology(config, processes=1, **keys):
    config.rl.topology.update(keys)
    return Topology.from_config(config, processes)


@pytest.mark.parametrize("keys,asynchronous,processes,kind,scatter,words", [
    ({}, False, 1, Kind.IN_PROCESS, False, "sync mode, the actor in this process"),
    ({}, True, 2, Kind.IN_PROCESS, False, "async mode, the actor in this process"),
    ({"colocated": True}, False, 1, Kind.COLOCATED, False,
     "sync mode, the actor in this process, colocated (weights copied on device)"),
    ({"colocated": True}, False, 2, Kind.COLOCATED, True,
     "sync mode, the actor in this process, colocated (weights copied on device) driven by process 0 of 2"),
    ({"actors": 1}, False, 1, Kind.RAY_ACTORS, False, "sync mode, 1 Ray actor(s)"),
    ({"actors": 3}, True, 4, Kind.RAY_ACTORS, True, "async mode, 3 Ray actor(s) driven by process 0 of 4"),
    ({"actors": 2, "actor_processes": 2}, True, 2, Kind.RAY_GROUPS, True,
     "async mode, 2 Ray actor group(s) of 2 processes driven by process 0 of 2"),
])
def test_each_deployment_is_one_kind(quickstart_grpo, keys, asynchronous, processes, kind, scatter, words):
    quickstart_grpo.rl.topology.asynchronous = asynchronous
    t = topology(quickstart_grpo, processes, **keys)
    assert (t.kind, t.scatter, t.describe()) == (kind, scatter, words)
    assert t.actors == max(int(quickstart_grpo.rl.topology.actors), 1)
    assert t.on_ray == (kind in (Kind.RAY_ACTORS, Kind.RAY_GROUPS))


def test_the_weight_path_has_the_serving_dtype(quickstart_grpo):
    c = quickstart_grpo
    c.model.dtype, c.rl.engine_dtype = "bfloat16", ""
    assert topology(c).dtype == jnp.bfloat16  # "" = model.dtype
    c.rl.engine_dtype = "float32"
    assert topology(c).dtype == jnp.float32


def test_each_process_drives_its_share_of_the_tasks_unless_process_0_scatters(quickstart_grpo):
    tasks = [f"t{i}" for i in range(10)]  # 2 steps of 4; the last 2 make no step
    quickstart_grpo.rl.topology.asynchronous = True
    in_process = topology(quickstart_grpo, 2)
    assert in_process.tasks_of(tasks, 4, 0) == ([(0, "t0"), (1, "t1"), (4, "t4"), (5, "t5")], 2)
    assert in_process.tasks_of(tasks, 4, 1) == ([(2, "t2"), (3, "t3"), (6, "t6"), (7, "t7")], 2)
    on_ray = topology(quickstart_grpo, 2, actors=2)
    assert on_ray.tasks_of(tasks, 4, 0) == (list(enumerate(tasks[:8])), 4)


def test_rows_fed_whole_by_every_process_need_a_scatter(quickstart_grpo):
    quickstart_grpo.rl.topology.asynchronous = True
    topology(quickstart_grpo, 2, actors=1).check_rows(1, {"data": 1})  # process 0 sends each the whole batch
    topology(quickstart_grpo, 2, actors=0).check_rows(2, {"data": 2})  # each its own rows
    with pytest.raises(ValueError, match=r"feeds the whole batch .*use Ray actors"):
        topology(quickstart_grpo, 2, actors=0).check_rows(1, {"data": 1})


@pytest.mark.parametrize("keys,asynchronous,message", [
    ({"actors": -1}, False, r"^rl\.topology\.actors=-1 must be >= 0"),
    ({"actor_processes": 2}, True, r"^rl\.topology\.actor_processes=2 must be >= 1, and > 1 only with Ray actors"),
    ({"actors": 2}, False, r"^rl\.topology\.asynchronous=False runs one actor"),
    ({"colocated": True, "actors": 1}, False, r"rl\.topology\.colocated=True runs the actor in the learner's process"),
    ({"colocated": True}, True, r"need rl\.topology\.asynchronous=False"),
])
def test_keys_that_cannot_work_together_stop_at_start_up(quickstart_grpo, keys, asynchronous, message):
    quickstart_grpo.rl.topology.asynchronous = asynchronous
    with pytest.raises(ValueError, match=message):
        topology(quickstart_grpo, 1, **keys)
