"""Stage grpo's start-up checks (coder.stages.grpo.validate) of what the runtime cannot hold: the
in-process actor on a learner of several processes when one host cannot hold the whole model,
a draft depth beyond the MTP modules, an engine whose cache does not fit beside its weights; and
of its tasks where it reads them (coder.stages.grpo.stage_tasks): held-out tasks GRPO trains on.

The tests run one CPU process: a learner of several processes is `jax.process_count` replaced,
a host's memory and a device's limit (CPU devices report none) the actor module's readers
replaced, each set from the estimate (coder.rl.actor.engine_memory) just below or above it.
"""
import jax
import pytest

from coder.model import sharding
from coder.rl import actor as actor_lib
from coder.stages import grpo as grpo_stage


@pytest.fixture
def two_processes(monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 2)


def whole_model_bytes(config) -> int:
    return actor_lib.engine_memory(config, {axis: 1 for axis in sharding.AXES}).weights


def test_in_process_actors_on_two_processes_are_refused_when_a_host_cannot_hold_the_model(
        quickstart_grpo, two_processes, monkeypatch):
    c = quickstart_grpo
    grpo_stage.validate(c)  # the layout of tests/test_multiprocess.py's two-process job: one host holds it
    whole = whole_model_bytes(c)
    monkeypatch.setattr(actor_lib, "host_memory_bytes", lambda: whole - 1)
    with pytest.raises(ValueError) as e:
        grpo_stage.validate(c)
    assert str(e.value) == (
        "rl.topology.actors=0 and rl.topology.colocated=False on a learner of 2 processes: every process builds its own engine "
        "of the whole model on its own devices, from the weight store's whole version in its host memory, and the "
        f"whole model is {whole / 2 ** 20:.1f} MiB in float32, more than this host's {(whole - 1) / 2 ** 20:.1f} "
        "MiB of memory: set rl.topology.actors >= 1 (Ray actors, each an engine on its own slice) or rl.topology.colocated=True "
        "with rl.topology.asynchronous=False (one engine over the devices of all 2 processes)")
    c.rl.topology.colocated = True  # one engine over the job's devices, sharded: no host holds the whole model
    grpo_stage.validate(c)
    c.rl.topology.colocated, c.rl.topology.actors = False, 1  # Ray actors: each checks its own slice (make_engine)
    grpo_stage.validate(c)


def test_in_process_actors_on_two_processes_are_refused_when_their_devices_cannot_hold_it(
        quickstart_grpo, two_processes, monkeypatch):
    c = quickstart_grpo
    one_row = actor_lib.engine_memory(c, actor_lib.engine_mesh_shape(c, 8)).per_device(1)
    monkeypatch.setattr(actor_lib, "device_bytes_limit", lambda devices: one_row - 1)
    with pytest.raises(ValueError, match=r"^rl\.topology\.actors=0 and rl\.topology\.colocated=False on a learner of 2 processes: "
                                         r".*its weights and one row at rl\.context_budget=1024 need .* MiB per device "
                                         r"over this process's 8 devices, .*set rl\.topology\.actors >= 1 .* or "
                                         r"rl\.topology\.colocated=True"):
        grpo_stage.validate(c)
    monkeypatch.setattr(jax, "process_count", lambda: 1)  # one process: the engine's own keys are named
    with pytest.raises(ValueError, match=r"^rl\.context_budget=1024: the RL engine"):
        grpo_stage.validate(c)


def test_an_engine_over_the_device_limit_stops_the_stage(quickstart_grpo, monkeypatch):
    c = quickstart_grpo
    mem = actor_lib.engine_memory(c, actor_lib.engine_mesh_shape(c, 8))
    limit = {"bytes": mem.per_device(1) - 1}
    seen = []

    def device_limit(devices):
        seen.append(len(list(devices)))
        return limit["bytes"]

    monkeypatch.setattr(actor_lib, "device_bytes_limit", device_limit)
    with pytest.raises(ValueError, match=r"^rl\.context_budget=1024: .*rl\.engine_mesh=.*rl\.engine_dtype="):
        grpo_stage.validate(c)
    limit["bytes"] = mem.weights + 2 * mem.slot  # one row fits; a pool of 16 rows (2 per device) at most
    with pytest.raises(ValueError, match=r"^rl\.engine_slots=0 \(32 rows.*set rl\.engine_slots <= 16"):
        grpo_stage.validate(c)
    c.rl.engine_slots = 16
    grpo_stage.validate(c)
    c.rl.topology.actors = 1  # Ray actors' engines are on their own slices: not this process's devices
    c.rl.engine_slots = 0
    grpo_stage.validate(c)
    assert seen == [8, 8, 8]


@pytest.mark.parametrize("k,message", [
    (-1, r"^rl\.speculative_k=-1 must be >= 0 \(0 = no speculative decoding\)$"),
    (2, (r"^rl\.speculative_k=2: each drafted token takes one MTP module, and the model has "
         r"model\.num_mtp_layers=1: set rl\.speculative_k <= 1$")),
])
def test_a_draft_depth_beyond_the_mtp_modules_stops_the_stage(quickstart_grpo, k, message):
    c = quickstart_grpo
    c.rl.speculative_k = 1  # the quickstart's one MTP module
    grpo_stage.validate(c)
    c.rl.speculative_k = k
    with pytest.raises(ValueError, match=message):
        grpo_stage.validate(c)


def test_a_draft_depth_without_mtp_modules_names_both_keys(quickstart_grpo):
    c = quickstart_grpo
    c.rl.speculative_k, c.model.num_mtp_layers = 1, 0
    with pytest.raises(ValueError, match=r"^rl\.speculative_k=1: .*no MTP modules \(model\.num_mtp_layers=0\): "
                                         r"set rl\.speculative_k=0"):
        grpo_stage.validate(c)


def _repo_task(tid: str, repo: str):
    from coder.env.tasks import Task

    return Task(tid, "fix it", {}, {}, source="swebench", metadata={"repo": repo})


def test_held_out_tasks_that_share_ids_or_repositories_with_the_training_tasks_are_refused(quickstart_grpo, tmp_path):
    """Two task files for rl.tasks and rl.eval_tasks: a held-out task GRPO also trains on, or a
    repository with tasks in both, stops the stage where it reads its tasks, at its start, naming
    them (only one source was split: two files passed silently)."""
    from coder.env.tasks import write_tasks

    c = quickstart_grpo
    train, held = str(tmp_path / "train.jsonl"), str(tmp_path / "held.jsonl")
    write_tasks(train, [_repo_task("a-1", "octo/a"), _repo_task("b-1", "octo/b"), _repo_task("c-1", "octo/c")])
    write_tasks(held, [_repo_task("c-1", "octo/c"), _repo_task("b-2", "octo/b"), _repo_task("e-1", "octo/e")])
    c.rl.tasks, c.rl.eval_tasks, c.rl.eval_num_tasks, c.rl.train_num_tasks = train, held, 3, 0
    with pytest.raises(ValueError) as e:
        grpo_stage.stage_tasks(c)
    assert str(e.value) == (
        f"rl.tasks={train!r} and rl.eval_tasks={held!r} overlap: held-out tasks GRPO trains on ['c-1'] (1), "
        "repositories with tasks in both ['octo/b', 'octo/c'] (2): the agent eval would measure work GRPO trains "
        "on. Take them out of one file, or give both keys one source (its last rl.eval_num_tasks=3 tasks are held "
        "out, the others trained on)")
    write_tasks(held, [_repo_task("e-1", "octo/e"), _repo_task("f-1", "octo/f")])
    c.rl.eval_num_tasks = 2
    tasks, trained, held_out = grpo_stage.stage_tasks(c)  # disjoint in ids and repositories
    assert sorted(t.id for t in trained) == ["a-1", "b-1", "c-1"] and len(held_out) == 2
    c.rl.eval_tasks = train  # one source: its last task held out, the others trained on
    c.rl.eval_num_tasks = 1
    tasks, trained, held_out = grpo_stage.stage_tasks(c)
    assert len(trained) == 2 and len(held_out) == 1 and {t.id for t in trained + held_out} == {"a-1", "b-1", "c-1"}
