"""config.plan: the quickstart chain compiled stage by stage for a TPU v5e 2x2 slice (libtpu on
this CPU), plan.json's contract, and the plan's own arithmetic (the slot search, the GRPO
balance, the actor layout checks) on stand-in figures."""
import json
import os
import types

import pytest

from coder.stages import plan as P

libtpu = pytest.importorskip("libtpu", reason="the tpu extra (libtpu) is needed for TPU topologies")

GiB = 2**30


def _quickstart():
    from configs import quickstart

    c = quickstart.get_config()
    c.plan = True
    c.compile.topology = "v5e-4"
    c.model.dtype = "bfloat16"  # as on a TPU
    # every stage's micro-batch divides over the slice's 4 chips (the run's own 1 and 2 rows do not)
    c.longctx.batch_size = 4
    c.sft.batch_size = 4
    return c


@pytest.fixture(scope="module")
def quickstart_plan(tmp_path_factory):
    from coder import stages

    config = _quickstart()
    config.workdir = str(tmp_path_factory.mktemp("plan"))
    assert stages.validate(config) == list(config.stages)  # against the slice's chips, no sandbox tools
    result = P.run(config)
    with open(os.path.join(config.workdir, "plan", "plan.json")) as f:
        on_disk = json.load(f)
    md = open(os.path.join(config.workdir, "plan", "plan.md")).read()
    return config, result, on_disk, md


@pytest.mark.slow
def test_quickstart_chain_plan_compiles_every_program_of_every_stage(quickstart_plan):
    config, plan, on_disk, md = quickstart_plan
    assert on_disk["stages"] == json.loads(json.dumps(plan["stages"], default=str))
    assert [r["stage"] for r in plan["stages"]] == list(config.stages)
    programs = {r["stage"]: [p["name"] for p in r["programs"]] for r in plan["stages"]}
    assert programs == {"pretrain": ["train_step"], "longctx": ["train_step"], "mtp": ["mtp_step"],
                        "sft": ["train_step"], "grpo": ["grpo_step", "engine_prefill", "engine_decode", "engine_copy"],
                        "eval": ["engine_prefill", "engine_decode", "engine_copy"]}
    for row in plan["stages"]:
        for p in row["programs"]:
            assert p["status"] == "fits", (row["stage"], p)
            assert 0 < p["gib_per_chip"] < p["hbm_gib"]
            assert 0 < p["step_s_overlap"] <= p["step_s_serial"]
        assert row["fits"] and row["chips"] == 4
    by = {r["stage"]: r for r in plan["stages"]}
    # each stage on its own config: longctx's rows and YaRN, sft's batch, pretrain's
    long_prog = by["longctx"]["programs"][0]
    assert (long_prog["rows"], long_prog["seq_len"]) == (4, config.longctx.seq_len)
    assert by["sft"]["programs"][0]["rows"] == 4
    assert (by["pretrain"]["programs"][0]["rows"], by["pretrain"]["programs"][0]["seq_len"]) == (
        config.data.batch_size, config.data.seq_len)
    for name in ("pretrain", "longctx", "mtp", "sft"):
        r = by[name]
        assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / r["step_s"])
        assert r["hours"] == pytest.approx(r["steps"] * r["step_s"] / 3600)
        assert r["chip_hours"] == pytest.approx(4 * r["hours"])
    steps = {"pretrain": config.train.steps, "longctx": config.longctx.steps, "mtp": config.mtp.steps,
             "sft": config.sft.steps, "grpo": config.grpo.steps}
    assert {k: by[k]["steps"] for k in steps} == steps
    assert plan["total_hours"] == pytest.approx(sum(r["hours"] or 0 for r in plan["stages"]))


@pytest.mark.slow
def test_quickstart_plan_balances_grpo_from_its_compiled_programs(quickstart_plan):
    config, plan, on_disk, md = quickstart_plan
    g = on_disk["grpo"]
    for key in ("actor_slices_per_learner", "decode_tokens_per_s_per_slice", "sync_s_per_version",
                "learner_step_s", "engine_slots_fit"):
        assert key in g, key
    slots = config.rl.tasks_per_step * config.rl.group_size  # rl.engine_slots = 0: the step's rollouts
    assert g["engine_slots"] == slots
    decode = next(p for p in plan["stages"][4]["programs"] if p["name"] == "engine_decode")
    assert decode["rows"] == slots and decode["cache_tokens"] == config.rl.context_budget
    assert g["decode_tokens_per_s_per_slice"] == pytest.approx(slots / decode["step_s_serial"])
    # the search compiled the configured count and went past it: a tiny model fits 8x on 4 chips
    search = g["engine_slots_search"]
    tried = {c["slots"]: c["fits"] for c in search["compiles"]}
    assert tried[slots] and g["engine_slots_fit"] >= slots and search["capped"]
    # lockstep GRPO (the quickstart's): the step is the rollouts then the learner
    assert not g["overlapped"] and g["oldest_token_staleness"] == 0
    assert g["step_s"] == pytest.approx(g["learner_step_s"] + g["rollout_batch_s_per_slice"])
    assert g["sync_s_per_version"]["anchor"] > g["sync_s_per_version"]["delta"] > 0
    assert "| stage | chips |" in md and "## GRPO" in md


def test_expected_tokens_per_decode_step():
    assert P.expected_tokens_per_step(0, 0.7) == 1
    assert P.expected_tokens_per_step(2, 0.5) == pytest.approx(1.75)


def _stand_in_engine(monkeypatch, bytes_of_rows):
    """compile_engine_at replaced by a decode program of `bytes_of_rows(n)` bytes per chip."""
    calls = []

    def fake(config, mesh, topo, slots, programs=("prefill", "decode")):
        calls.append(slots)
        used = bytes_of_rows(slots)
        if used <= topo.chip.hbm_bytes:
            return {"decode": {"memory": {"fits": True, "total_bytes": used}}}
        return {"decode": {"status": "does_not_fit", "memory_overflow": {"used_bytes": used}}}

    monkeypatch.setattr(P, "compile_engine_at", fake)
    return calls


def _search(monkeypatch, config, slots, bytes_of_rows, shards=4):
    calls = _stand_in_engine(monkeypatch, bytes_of_rows)
    mesh = types.SimpleNamespace(shape={"data": shards, "fsdp": 1, "expert": 1, "tensor": 1, "sequence": 1})
    topo = types.SimpleNamespace(chip=types.SimpleNamespace(hbm_bytes=95 * GiB))
    result = P.largest_fitting_slots(config, mesh, topo, P.compile_engine_at(config, mesh, topo, slots), slots)
    return result, calls


def test_slot_search_finds_the_largest_count_that_fits_by_compiling(monkeypatch):
    config = _quickstart()
    # 10 GiB of weights and 0.7 GiB a row: 120 rows fit (94 GiB), 124 do not; rows come in 4s
    result, calls = _search(monkeypatch, config, 32, lambda n: 10 * GiB + n * 0.7 * GiB)
    assert result["slots"] == 120 and result["does_not_fit_at"] == 124
    assert not result["bounded_by_compiles"] and not result["capped"]
    assert {c["slots"]: c["fits"] for c in result["compiles"]}[124] is False
    assert len(calls) <= 7


def test_slot_search_walks_down_when_the_configured_count_does_not_fit(monkeypatch):
    config = _quickstart()
    # a superlinear program (temporaries grow with rows): the linear guess overshoots
    result, _ = _search(monkeypatch, config, 64, lambda n: 20 * GiB + n * 0.5 * GiB + (n * n / 200) * GiB)
    fits = {c["slots"]: c["fits"] for c in result["compiles"]}
    best = result["slots"]
    assert fits[best] and not fits[best + 4]
    assert 20 + best * 0.5 + best * best / 200 <= 95 < 20 + (best + 4) * 0.5 + (best + 4) ** 2 / 200


def test_slot_search_stops_at_its_cap_for_a_model_far_smaller_than_the_chip(monkeypatch):
    config = _quickstart()
    result, _ = _search(monkeypatch, config, 32, lambda n: 0.01 * GiB + n * 1e-4 * GiB)
    assert result["capped"] and result["slots"] == 8 * 32 and result["does_not_fit_at"] is None


def test_actor_layout_must_be_the_slice_the_run_starts():
    config = _quickstart()
    config.rl.topology.actors, config.rl.topology.actor_processes = 2, 4
    with pytest.raises(ValueError, match="compile.engine_topology"):
        P.engine_layout(config, None, None)
    config.compile.engine_topology = "v5p-256"  # 32 hosts of 4 chips, not 4 processes
    with pytest.raises(ValueError, match="rl.topology.actor_processes=4"):
        P.engine_layout(config, None, None)
    config.rl.topology.actors = 0
    with pytest.raises(ValueError, match="learner's process"):
        P.engine_layout(config, None, None)


def _balance(config, *, learner_s, decode_s, prefill_s):
    learner = {"step_s_serial": learner_s, "step_s_overlap": learner_s / 2, "rows": 8, "seq_len": 1024}
    engine = {"setup": {"rows": 32, "prefill_len": 256}, "weights_from": "store",
              "store_read_seconds_per_host": 2.0,
              "decode": {"roofline": {"step_time_serial_s": decode_s, "step_time_lower_s": decode_s}},
              "prefill": {"roofline": {"step_time_serial_s": prefill_s}}}
    topo = types.SimpleNamespace(num_chips=8, chips_per_host_bounds=(2, 2, 1),
                                 chip=types.SimpleNamespace(dcn_bandwidth=1e9))
    return P.grpo_plan(config, learner, engine, {"slots": 64}, topo)


def test_grpo_balance_counts_the_slices_that_keep_an_async_learner_fed():
    config = _quickstart()
    config.rl.topology.asynchronous = True
    config.rl.topology.actors = 2
    config.rl.tasks_per_step, config.rl.group_size = 4, 8  # 32 rollouts
    config.rl.max_rollout_tokens, config.compile.rollout_tokens = 512, 1024
    config.rl.speculative_k, config.compile.draft_acceptance = 1, 0.5
    config.grpo.max_staleness = 3
    g = _balance(config, learner_s=10.0, decode_s=0.1, prefill_s=1.0)
    decode_tps = 32 * 1.5 / 0.1  # 1.5 tokens a row a step
    prefill_tps = 32 * 256 / 1.0
    batch_s = 32 * (512 / decode_tps + 512 / prefill_tps)
    assert g["decode_tokens_per_s_per_slice"] == pytest.approx(decode_tps)
    assert g["rollout_batch_s_per_slice"] == pytest.approx(batch_s)
    assert g["actor_slices_per_learner"] == 4  # 36 s of rollouts a 10 s step
    assert g["step_s"] == pytest.approx(batch_s / 2)  # the 2 configured slices bound the step
    latency = 512 / 1.5 * 0.1 + 512 / (prefill_tps / 32)
    assert g["rollout_latency_s"] == pytest.approx(latency)
    assert g["oldest_token_staleness"] == 4 and not g["staleness_ok"]  # 36 s rows, 10 s steps: 4 > 3
    assert g["sync_s_per_version"]["actor_read_anchor_per_host"] == 2.0
    assert g["sync_s_per_version"]["delta"] == pytest.approx(g["sync_s_per_version"]["anchor"] * P.DELTA_FRACTION)


def test_a_rerun_reuses_the_stages_planned_at_the_same_config_and_commit(tmp_path, monkeypatch):
    """An interrupted or repeated plan does not compile again what it already compiled: each
    stage's result is kept under a key of its config, target and commit; a stage whose config
    changed is planned again, the others are not."""
    planned = []

    def fake_stage(name, config, mesh, topo, cache, run=None):
        planned.append(name)
        row = {"stage": name, "chips": 4, "step_s": 1.0, "step_s_overlap": 0.5, "tokens_per_step": 10,
               "tokens_per_s": 10.0, "steps": 1, "hours": 1 / 3600, "chip_hours": 4 / 3600, "fits": True,
               "programs": [{"name": "train_step", "status": "fits", "gib_per_chip": 1.0, "hbm_gib": 15.0,
                             "step_s_serial": 1.0, "step_s_overlap": 0.5, "compile_s": 0.0}]}
        return row, None

    monkeypatch.setattr(P, "plan_stage", fake_stage)
    monkeypatch.setattr(P, "_commit", lambda: "abc123")
    monkeypatch.setattr(P, "_dirty", lambda: False)
    config = _quickstart()
    config.stages = ("pretrain", "longctx", "mtp")
    config.workdir = str(tmp_path)
    P.run(config)
    assert planned == ["pretrain", "longctx", "mtp"]
    P.run(config)
    assert planned == ["pretrain", "longctx", "mtp"]  # all three reused
    config.longctx.lr = 0.5 * config.longctx.lr
    plan = P.run(config)
    assert planned[3:] == ["longctx"] and plan["complete"]
    monkeypatch.setattr(P, "_dirty", lambda: True)  # uncommitted code: nothing reused
    P.run(config)
    assert planned[4:] == ["pretrain", "longctx", "mtp"]


def test_a_stage_interrupted_between_programs_recompiles_only_the_rest(tmp_path):
    """GRPO's stage is several long compiles (learner step, engine, slot probes): each program's
    record is on disk when it ends, so a rerun under the same key starts where the last stopped."""
    compiled = []

    def program(name, fail=False):
        def compile_fn():
            compiled.append(name)
            if fail:
                raise KeyboardInterrupt  # the plan stopped mid-compile
            return {"status": "fits", "memory": {"total_bytes": 1.0, "fits": True}}
        return compile_fn

    store = P.ProgramStore(str(tmp_path), "grpo", "key1")
    assert store.run("grpo_step", program("grpo_step"))["status"] == "fits"
    with pytest.raises(KeyboardInterrupt):
        store.run("engine_at_8_slots", program("engine_at_8_slots", fail=True))
    again = P.ProgramStore(str(tmp_path), "grpo", "key1")
    again.run("grpo_step", program("grpo_step"))
    again.run("engine_at_8_slots", program("engine_at_8_slots"))
    assert compiled == ["grpo_step", "engine_at_8_slots", "engine_at_8_slots"]
    P.ProgramStore(str(tmp_path), "grpo", "key2").run("grpo_step", program("grpo_step"))  # config changed
    P.ProgramStore(str(tmp_path), "grpo", "").run("grpo_step", program("grpo_step"))  # uncommitted code
    assert compiled[3:] == ["grpo_step", "grpo_step"]
