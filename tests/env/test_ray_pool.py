"""Env workers as Ray actors (coder/env/ray_pool.py) against the local pool (coder/env/pool.py):
the same results for the same tool calls, a killed or hung actor handled as the local pool
handles a dead or hung worker process, placement by env.ray_resource, the backend key checked,
and the concurrent actor's rollouts equal on both backends (env.workers_backend).

One local Ray instance for the module, with 4 logical CPUs and an `env_node` resource standing
for the CPU nodes of a cluster.
"""

import re
import time

import jax
import pytest

from coder.data import tokenizer as tokenizer_lib
from coder.env import protocol
from coder.env.tools import registry as env_tools
from coder.env.pool import PooledEpisode
from coder.env.protocol import ToolCall
from coder.env.runtime.sandbox import InfraError
from coder.env.tasks import toy_tasks
from coder.rl import actor as actor_lib
from coder.rl import agent as agent_lib
from coder.stages import grpo as grpo_stage
from configs import base
from tests.rl.scripted_engine import ScriptedEngine, call_ids


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(
        address="local", num_cpus=4, include_dashboard=False, resources={"env_node": 1}
    )
    yield ray
    ray.shutdown()


def _config(backend: str, **env):
    c = base.get_config()
    c.rl.tools = ()  # every tool: shell too
    c.env.semantic_encoder = ""  # no checkpoint to embed with (tests/env/tools/test_semantic_search.py)
    c.env.workers_backend = backend
    c.env.update(env)
    return c


# travels by reference: this test module is not importable in Ray's workers
def _refuse(x):
    raise ValueError(f"refused {x}")


def _session(pool, pairs) -> list:
    """The same tool calls, per-call and batch, on `pool`; what came back, pytest's timing
    stripped."""
    out = []
    eps = [PooledEpisode(pool, t, key=f"k{i}") for i, (t, _) in enumerate(pairs)]
    assert sorted(pool._owner.values()) == [0, 1]  # one episode per worker
    fix = ToolCall(
        "write_file", {"path": "answer.py", "content": pairs[0][1]["answer.py"]}, ""
    )
    for i, ep in enumerate(eps):
        assert not ep.error
        calls = [ToolCall("read_file", {"path": "answer.py"}, "")] + [fix] * (i == 0)
        calls += [
            ToolCall("shell", {"command": "cat answer.py; ulimit -v"}, ""),
            ToolCall("run_tests", {}, ""),
            ToolCall("submit", {}, ""),
        ]
        out += [re.sub(r"in [0-9.]+s", "in Ts", ep.call(c)) for c in calls]
        out.append((ep.done, ep.lint_count(), ep.score()))
        ep.close()
    obs = pool.reset([(i, t, None) for i, (t, _) in enumerate(pairs)])
    steps = pool.step([(0, protocol.render_tool_call("submit", {})), (1, "no call")])
    out += [
        obs,
        [
            (o, d, {k: v for k, v in info.items() if k != "messages"})
            for o, d, info in steps
        ],
    ]
    out.append(pool.map(abs, [-1, 2, -3]))  # a builtin: importable in the actors
    return out


@pytest.mark.slow
def test_ray_pool_gives_the_local_pools_results(ray_local):
    pairs = toy_tasks(2, seed=3)
    local = actor_lib.episode_factory(_config("local"))
    with local.pool(2) as pool:
        expected = _session(pool, pairs)
    rewards = [o[2][0] for o in expected if isinstance(o, tuple)]
    assert rewards == [1.0, 0.0]  # the fix passed, no fix failed
    assert expected[-1] == [1, 2, 3]
    # the env's limits reached the sandbox (ulimit -v, KiB)
    assert str(base.get_config().env.memory_mb << 10) in expected[2]

    def env_node_free(expected: float) -> float:
        """Ray's free `env_node` once it is `expected` (its view lags a little), or in 10 s."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            free = ray_local.available_resources().get("env_node", 0.0)
            if free == pytest.approx(expected):
                break
            time.sleep(0.1)
        return free

    ray_factory = actor_lib.episode_factory(_config("ray", ray_resource="env_node"))
    with ray_factory.pool(2) as pool:
        assert type(pool).__name__ == "RayEpisodePool"
        # each actor holds a share of env_node: they run only on nodes that declare it
        assert env_node_free(1.0 - 0.002) == pytest.approx(0.998)
        got = _session(pool, pairs)
    assert got == expected
    assert env_node_free(1.0) == pytest.approx(1.0)  # closed: the actors are gone


@pytest.mark.slow
def test_killed_actor_turns_calls_into_infra_errors_and_is_replaced(ray_local):
    """tests/env/test_pool.py's dead-worker test, the worker a Ray actor killed by Ray."""
    from coder.env.ray_pool import RayEpisodePool

    ((task, _),) = toy_tasks(1, seed=6)
    with RayEpisodePool(1, token_count=len, tools=("shell", "submit")) as pool:
        ep = PooledEpisode(pool, task)
        assert "exit code: 0" in ep.call(ToolCall("shell", {"command": "true"}, ""))
        worker = pool._workers[0]
        killed, name = worker.actor, worker.name
        # a call that fails in the worker (its function raises there) is not a death
        with pytest.raises(RuntimeError, match="pool map failed in a worker(.|\n)*refused 2"):
            pool.map(_refuse, [2])
        assert "exit code: 0" in ep.call(ToolCall("shell", {"command": "true"}, ""))
        ray_local.kill(killed)
        # Ray saw it die (the kill is asynchronous: a call submitted right after may still run)
        deadline = time.monotonic() + 60
        with pytest.raises(ray_local.exceptions.RayActorError):
            while time.monotonic() < deadline:
                ray_local.get(killed.ready.remote(), timeout=30)
                time.sleep(0.2)
        with pytest.raises(
            InfraError, match=re.escape(name) + " died during .*: shell"
        ):
            ep.call(ToolCall("shell", {"command": "true"}, ""))
        with pytest.raises(InfraError):
            ep.score()
        ep.close()
        fresh = PooledEpisode(pool, task)  # a new actor for new episodes
        assert not fresh.error and worker.name != name and worker.name.endswith(".2)")
        assert "exit code: 0" in fresh.call(ToolCall("shell", {"command": "true"}, ""))
        with pytest.raises(InfraError):  # the lost episode stays lost
            ep.call(ToolCall("shell", {"command": "true"}, ""))
        fresh.close()


@pytest.mark.slow
def test_hung_actor_times_out_as_infra_error_and_is_replaced(ray_local):
    from coder.env.ray_pool import RayEpisodePool

    ((task, _),) = toy_tasks(1, seed=7)
    # 10 s, not 2: a new worker's first open prepares the task's tree and starts the sandbox over
    # it (0.3 s on a quiet machine; past 2 s on a loaded 2-core one, and once past 6 s in the
    # fresh CI beside a multi-process test, when it also walked /usr: `pool.warm_up` now does
    # that before the actor counts as started); the hung call sleeps 20 s
    with RayEpisodePool(1, timeout_s=10.0, token_count=len, tools=("shell",)) as pool:
        pool.open("a", task)
        with pytest.raises(InfraError, match="took more than 10.0 s"):
            pool.call("a", ToolCall("shell", {"command": "sleep 20"}, ""))
        pool.open("b", task)  # the killed actor is replaced
        assert "exit code: 0" in pool.call(
            "b", ToolCall("shell", {"command": "true"}, "")
        )


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")  # 4 CPUs, no cpu_node resource
def test_actors_the_cluster_cannot_place_fail_at_start_naming_the_key():
    from coder.env.ray_pool import RayEpisodePool

    with pytest.raises(
        RuntimeError, match=r"env.ray_resource='cpu_node'.*'cpu_node': 0"
    ):
        RayEpisodePool(1, token_count=len, resource="cpu_node", start_timeout_s=1.0)
    with pytest.raises(RuntimeError, match=r"env.ray_num_cpus_per_worker=64.0"):
        RayEpisodePool(1, token_count=len, num_cpus=64, start_timeout_s=1.0)


def test_bad_worker_keys_stop_at_start_naming_the_key():
    c = _config("kubernetes")
    for check in (grpo_stage.validate, actor_lib.episode_factory):
        with pytest.raises(ValueError, match=r"env.workers_backend='kubernetes'"):
            check(c)
    c = _config("ray", ray_num_cpus_per_worker=0.0)
    with pytest.raises(
        ValueError, match=r"env.ray_num_cpus_per_worker=0.0 must be > 0"
    ):
        actor_lib.episode_factory(c)


POOLS = {"local": "EpisodePool", "ray": "RayEpisodePool"}


@pytest.mark.slow
def test_concurrent_actor_rolls_out_the_same_on_both_backends(ray_local):
    """The agent loop end to end (scripted engine, real sandboxes): every row writes task 0's
    fix and submits; the rollouts and each row's whole context (tool outputs included) are the
    same whether the env workers are local processes or Ray actors."""
    pairs = toy_tasks(2, seed=5)
    tok = tokenizer_lib.train_tokenizer(
        [protocol.render_system_prompt(env_tools.SPECS), agent_lib.SUMMARY_REQUEST]
        + [t.prompt for t, _ in pairs]
        + [s["answer.py"] for _, s in pairs],
        400,
    )
    script = [
        call_ids(
            tok,
            "write_file",
            {"path": "answer.py", "content": pairs[0][1]["answer.py"]},
        ),
        call_ids(tok, "submit", {}),
    ]

    def respond(ctx, row):
        return script[min(1, sum(1 for t in ctx if t == tok.special_id("tool")))]

    out = {}
    for backend in ("local", "ray"):
        c = base.get_config()
        c.rl.update(
            {
                "context_budget": 4096,
                "summary_reserve": 64,
                "max_turn_tokens": 400,
                "group_size": 2,
                "concurrent": True,
                "env_workers": 2,
            }
        )
        c.env.workers_backend = backend
        engine = ScriptedEngine(respond)
        actor = actor_lib.Actor(engine, tok, c, actor_lib.episode_factory(c))
        try:
            groups = actor.collect([t for t, _ in pairs], jax.random.key(0))
            assert type(actor.pool).__name__ == POOLS[backend]
        finally:
            actor.close()
        rows = [
            [(r.finish, r.correct, r.test_reward, r.tool_calls) for r in g]
            for g in groups
        ]
        out[backend] = rows, sorted(tuple(row) for g in engine.groups for row in g.rows)
    assert out["local"][0] == [
        [("submit", True, 1.0, 2)] * 2,
        [("submit", False, 0.0, 2)] * 2,
    ]
    assert out["ray"] == out["local"]
