"""Stage realtime's start-up checks of its eval gate's engine (coder.stages.realtime.validate):
refused on a learner of several processes (the gate's engine is built on each process's own
devices from the learner's whole state), and against its devices' memory on one process.

One CPU process: several processes are `jax.process_count` replaced, a device's limit (CPU
devices report none) the actor module's reader replaced.
"""
import jax
import pytest

from coder.rl import actor as actor_lib
from coder.stages import realtime as realtime_stage
from coder.stages import stage_config
from configs import quickstart


@pytest.fixture
def config(tmp_path):
    c = quickstart.get_config()
    c.serve.weight_store = str(tmp_path / "weights")
    return stage_config("realtime", c)


def test_the_eval_gate_on_several_processes_is_refused_naming_rl_eval_num_tasks(config, monkeypatch):
    realtime_stage.validate(config)  # one process, the gate on (the quickstart's 9 held-out tasks)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError) as e:
        realtime_stage.validate(config)
    assert str(e.value) == (
        "rl.eval_num_tasks=9 turns on the eval gate, whose engine is built on each process's own devices and takes "
        "the learner's whole state: on a learner of 2 processes every host would gather the whole model from all "
        "of them onto its devices. Set rl.eval_num_tasks=0 (0 turns the gate off: every trained cycle is "
        "published), or run stage realtime on one process")
    config.rl.eval_num_tasks = 0  # the gate off: no engine
    realtime_stage.validate(config)


def test_the_gate_engine_over_the_device_limit_stops_the_stage(config, monkeypatch):
    mem = actor_lib.engine_memory(config, actor_lib.engine_mesh_shape(config, 8))
    monkeypatch.setattr(actor_lib, "device_bytes_limit", lambda devices: mem.per_device(1) - 1)
    with pytest.raises(ValueError, match=r"^rl\.context_budget=1024: the RL engine .*rl\.engine_mesh=.*"
                                         r"rl\.engine_dtype="):
        realtime_stage.validate(config)
    config.rl.eval_num_tasks = 0
    realtime_stage.validate(config)
