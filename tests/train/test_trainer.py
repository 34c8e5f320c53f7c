"""Trainer pieces: loss masks, gradient accumulation, non-finite steps, init_from, optimizers.

A toy nnx LM (embedding -> tanh layer -> head) with the Transformer's call signature keeps these
fast; the step, sharding and checkpoint code under test is the same the real model runs through.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coder.train import hooks, losses
from coder.train.balancing import router_balancing
from coder.train.trainer import Trainer, split_microbatches
from configs import base

V, D, B, T = 32, 16, 8, 12


class Toy(nnx.Module):
    def __init__(self, rngs, extra: bool = False):
        self.embed = nnx.Param(jax.random.normal(rngs.params(), (V, D)) * 0.5)
        self.w = nnx.Param(jax.random.normal(rngs.params(), (D, D)) * 0.5)
        self.lm_head = nnx.Param(jax.random.normal(rngs.params(), (D, V)) * 0.5)
        if extra:  # stands in for modules a later stage adds (fresh MTP heads)
            self.mtp_w = nnx.Param(jnp.full((D, D), 0.25))

    def __call__(self, tokens, positions, segment_ids):
        h = jnp.tanh(self.embed[...][tokens] @ self.w[...])
        if hasattr(self, "mtp_w"):
            h = h + 0.0 * (h @ self.mtp_w[...])
        return h @ self.lm_head[...], {}


def make_config(**train):
    c = base.get_config()
    c.train.steps = 10
    c.train.warmup_steps = 0
    c.train.lr = 1e-2
    c.train.log_every = 1
    c.train.ckpt_every = 1000
    for k, v in train.items():
        c.train[k] = v
    return c


def make_batch(seed=0, rows=B):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, V, (rows, T)).astype(np.int32)
    seg = np.ones((rows, T), np.int32)
    seg[:, T // 2:] = 2
    pos = np.concatenate([np.arange(T // 2), np.arange(T - T // 2)])[None].repeat(rows, 0).astype(np.int32)
    mask = np.ones((rows, T), np.float32)
    return dict(tokens=tokens, positions=pos, segment_ids=seg, loss_mask=mask)


def make_trainer(tmp_path, config, loss_fn=None, **kw):
    model_fn = kw.pop("model_fn", lambda: Toy(nnx.Rngs(0)))
    kw.setdefault("post_update", router_balancing(config.model))
    return Trainer(config, str(tmp_path), loss_fn or losses.lm_loss_fn(config.train),
                   model_fn=model_fn, **kw)


# ----------------------------------------------------------------------------- losses
def test_next_token_targets_follow_mask_and_segments():
    tokens = jnp.array([[5, 6, 7, 8, 9, 0]], jnp.int32)
    seg = jnp.array([[1, 1, 1, 2, 2, 0]], jnp.int32)
    mask = jnp.array([[1, 0, 1, 1, 1, 0]], jnp.float32)
    targets, w = losses.shifted_targets(tokens, seg, mask, 1)
    # index t predicts tokens[t+1]: 6 (mask 0), 7, 8 (first of doc 2: never a target), 9, pad.
    np.testing.assert_array_equal(targets, [[6, 7, 8, 9, 0]])
    np.testing.assert_array_equal(w, [[0, 1, 0, 1, 0]])
    targets2, w2 = losses.shifted_targets(tokens, seg, mask, 2)  # MTP depth 1
    np.testing.assert_array_equal(targets2, [[7, 8, 9, 0]])
    np.testing.assert_array_equal(w2, [[1, 0, 0, 0]])  # 8 and 9 sit in another doc than t


def test_lm_loss_is_mean_nll_over_weighted_targets():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(2, 6, V)), jnp.float32)
    batch = dict(
        tokens=jnp.asarray(rng.integers(1, V, (2, 6)), jnp.int32),
        segment_ids=jnp.array([[1, 1, 1, 1, 2, 2], [1, 1, 1, 0, 0, 0]], jnp.int32),
        loss_mask=jnp.array([[1, 1, 0, 1, 1, 1], [1, 1, 1, 0, 0, 0]], jnp.float32),
    )
    mean, count = losses.next_token_loss(logits, batch)
    logp = jax.nn.log_softmax(logits, -1)
    expected = []
    for b in range(2):
        for t in range(5):
            s = batch["segment_ids"]
            if s[b, t] == s[b, t + 1] and s[b, t + 1] > 0 and batch["loss_mask"][b, t + 1] > 0:
                expected.append(-logp[b, t, batch["tokens"][b, t + 1]])
    assert int(count) == len(expected) == 5
    np.testing.assert_allclose(mean, np.mean(expected), rtol=1e-6)


def test_pick_targets_is_take_along_axis_forward_and_backward():
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(size=(2, 5, V)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, V, (2, 5)), jnp.int32)
    cot = jnp.asarray(rng.normal(size=(2, 5)), jnp.float32)
    gather = lambda x: jnp.take_along_axis(x, targets[..., None], axis=-1)[..., 0]
    np.testing.assert_array_equal(losses.pick_targets(logits, targets), gather(logits))
    grad = lambda f: jax.grad(lambda x: jnp.sum(f(x) * cot))(logits)
    np.testing.assert_array_equal(grad(lambda x: losses.pick_targets(x, targets)), grad(gather))


def test_lm_loss_adds_weighted_mtp_and_z_loss():
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.normal(size=(1, 6, V)), jnp.float32)
    mtp_logits = jnp.asarray(rng.normal(size=(1, 1, 6, V)), jnp.float32)
    batch = dict(tokens=jnp.asarray(rng.integers(1, V, (1, 6)), jnp.int32),
                 segment_ids=jnp.ones((1, 6), jnp.int32), loss_mask=jnp.ones((1, 6), jnp.float32))
    aux = dict(mtp_logits=mtp_logits, router_z_loss=jnp.float32(3.0))
    loss, m = losses.lm_loss(logits, aux, batch, mtp_loss_weight=0.5, z_loss_weight=0.1)
    ce, _ = losses.next_token_loss(logits, batch)
    mtp, _ = losses.mtp_loss(mtp_logits, batch)
    np.testing.assert_allclose(loss, ce + 0.5 * mtp + 0.1 * 3.0, rtol=1e-6)
    np.testing.assert_allclose(m["mtp_ce"], mtp)


# ----------------------------------------------------------------------------- the step
def test_split_microbatches_strided_rows():
    x = np.arange(8)[:, None].repeat(3, 1)
    out = split_microbatches({"tokens": x, "expert_ids": np.zeros((2, 8, 3, 1))}, 2)
    np.testing.assert_array_equal(out["tokens"][0][:, 0], [0, 2, 4, 6])
    np.testing.assert_array_equal(out["tokens"][1][:, 0], [1, 3, 5, 7])
    assert out["expert_ids"].shape == (2, 2, 4, 3, 1)


def test_grad_accumulation_equals_big_batch(tmp_path):
    batch = make_batch(3)
    batch["loss_mask"][1::2, 2:] = 0.0  # odd rows (micro-batch 2) have far fewer targets
    results = []
    for accum in (1, 2):
        tr = make_trainer(tmp_path / f"a{accum}", make_config(grad_accum=accum))
        m = tr.train_step(batch)
        results.append((float(m["loss"]), float(m["grad_norm"]),
                        jax.tree.map(np.asarray, nnx.to_pure_dict(tr.params))))
        tr.close()
    (l1, g1, p1), (l2, g2, p2) = results
    np.testing.assert_allclose(l2, l1, rtol=1e-6)
    np.testing.assert_allclose(g2, g1, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), p1, p2)


def _poisoned_loss(train_cfg):
    base_fn = losses.lm_loss_fn(train_cfg)

    def loss_fn(model, batch, rng):
        loss, metrics = base_fn(model, batch, rng)
        return loss + jnp.sum(batch["poison"]), metrics  # NaN poison -> NaN loss and gradient

    return loss_fn


def test_nonfinite_step_is_skipped_and_counted(tmp_path):
    cfg = make_config(max_nonfinite_steps=3)
    tr = make_trainer(tmp_path, cfg, _poisoned_loss(cfg.train))
    good = dict(make_batch(0), poison=np.zeros((B,), np.float32))
    bad = dict(make_batch(0), poison=np.full((B,), np.nan, np.float32))
    tr.train_step(good)
    before = jax.tree.map(np.array, nnx.to_pure_dict(tr.params))
    opt_before = jax.tree.map(np.array, tr.opt_state)
    m = tr.train_step(bad)
    assert int(m["skipped"]) == 1 and tr.step == 2 and tr.nonfinite_total == 1
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.array, nnx.to_pure_dict(tr.params)))
    jax.tree.map(np.testing.assert_array_equal, opt_before, jax.tree.map(np.array, tr.opt_state))
    m = tr.train_step(good)  # a good step resets the run and updates again
    assert int(m["skipped"]) == 0 and tr.nonfinite_run == 0
    assert not np.array_equal(before["w"], np.asarray(tr.params["w"][...]))
    tr.train_step(bad)
    tr.train_step(bad)
    with pytest.raises(RuntimeError, match="max_nonfinite_steps=3"):
        tr.train_step(bad)
    tr.close()


def test_trainable_filter_freezes_the_rest(tmp_path):
    cfg = make_config()
    only_head = nnx.All(nnx.Param, nnx.PathContains("lm_head"))
    tr = make_trainer(tmp_path, cfg, trainable=only_head)
    w0 = np.asarray(tr.model.w[...])
    h0 = np.asarray(tr.model.lm_head[...])
    tr.train_step(make_batch(0))
    np.testing.assert_array_equal(w0, np.asarray(tr.model.w[...]))
    assert not np.array_equal(h0, np.asarray(tr.model.lm_head[...]))
    assert set(nnx.to_pure_dict(tr.params)) == {"lm_head"}
    tr.close()


def test_init_from_loads_by_name_and_keeps_new_params(tmp_path, monkeypatch):
    cfg = make_config()
    tr = make_trainer(tmp_path / "a", cfg)
    for s in range(3):
        tr.train_step(make_batch(s))
    tr.save(force=True)
    tr.close()
    trained_w = np.asarray(tr.params["w"][...])
    tr2 = make_trainer(tmp_path / "b", cfg, init_from=str(tmp_path / "a" / "checkpoints"),
                       model_fn=lambda: Toy(nnx.Rngs(1), extra=True))
    np.testing.assert_array_equal(np.asarray(tr2.params["w"][...]), trained_w)
    np.testing.assert_array_equal(np.asarray(tr2.params["mtp_w"][...]), np.full((D, D), 0.25))
    assert tr2.init_report["missing"] == ["mtp_w"] and tr2.step == 0
    tr2.close()
    # a path relative to the working directory, as a user types it (orbax's reads need absolute
    # paths: this raised from deep inside tensorstore)
    monkeypatch.chdir(tmp_path)
    tr3 = make_trainer(tmp_path / "c", cfg, init_from="a/checkpoints")
    np.testing.assert_array_equal(np.asarray(tr3.params["w"][...]), trained_w)
    tr3.close()


def test_muon_optimizer_trains(tmp_path):
    cfg = make_config(optimizer="muon", lr=2e-2)
    tr = make_trainer(tmp_path, cfg)
    batch = make_batch(5)
    first = float(tr.train_step(batch)["loss"])
    for _ in range(8):
        last = float(tr.train_step(batch)["loss"])
    assert last < first - 0.1
    tr.close()


def test_fit_writes_metrics_and_final_checkpoint(tmp_path):
    cfg = make_config(steps=4, log_every=2)

    def batches():
        i = 0
        while True:
            yield make_batch(i)
            i += 1

    tr = make_trainer(tmp_path, cfg)
    assert tr.fit(batches()) == 4
    tr.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    import json

    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [2, 4]
    assert all({"loss", "grad_norm", "lr", "tokens_per_s", "mfu"} <= set(r) for r in records)
    assert (tmp_path / "checkpoints" / "4").is_dir()



def _endless():
    i = 0
    while True:
        yield make_batch(i)
        i += 1


def test_fit_hooks_run_on_their_cadence_and_checkpoints_on_train_ckpt_every(tmp_path):
    """A caller's Hook(fn, every=3) runs at steps 3 and 6 of 7, its scalars in those steps' log
    lines; the checkpoint hook saves at multiples of train.ckpt_every before the last step, then
    the final one; after_step runs every step, before the hooks."""
    import json

    cfg = make_config(steps=7, log_every=1, ckpt_every=2, keep_checkpoints=10)
    tr = make_trainer(tmp_path, cfg)
    seen, saved, order = [], [], []
    save = tr.save
    tr.save = lambda force=False: (saved.append((tr.step, force)), save(force=force))

    def every3(trainer, info):
        assert info.step == trainer.step and info.steps == 7 and "loss" in info.metrics
        seen.append(info.step)
        order.append("hook")
        return {"custom": float(info.step)}

    def after(trainer, metrics):
        order.append("after")

    assert tr.fit(_endless(), after_step=after, hooks=[hooks.Hook(every3, every=3)]) == 7
    tr.close()
    assert seen == [3, 6]
    assert order[:4] == ["after", "after", "after", "hook"]
    assert saved == [(2, False), (4, False), (6, False), (7, True)]
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == [2, 4, 6, 7]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 8))
    assert [r["step"] for r in records if "custom" in r] == [3, 6]
    assert all(r["custom"] == r["step"] for r in records if "custom" in r)


def test_fit_sigterm_saves_the_step_and_raises_preempted(tmp_path):
    """SIGTERM during step 2 (sent by a hook): the preemption hook saves step 2, waits, raises
    Preempted (exit code 0) before the checkpoint cadence; the previous handler is back after."""
    import os
    import signal

    cfg = make_config(steps=6, ckpt_every=1000)
    tr = make_trainer(tmp_path, cfg)
    before = signal.getsignal(signal.SIGTERM)

    def term(trainer, info):
        os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(hooks.Preempted) as e:
        tr.fit(_endless(), hooks=[hooks.Hook(term, every=2)])
    tr.close()
    assert e.value.step == 2 and e.value.code == 0 and tr.step == 2
    assert signal.getsignal(signal.SIGTERM) is before
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == ["2"]

class ShardedToy(nnx.Module):
    """Toy LM whose parameters carry logical axes, so they shard over the mesh."""

    def __init__(self, rngs):
        self.embed = nnx.Param(jax.random.normal(rngs.params(), (V, D)) * 0.5, logical_axes=("vocab", "embed"))
        self.w = nnx.Param(jax.random.normal(rngs.params(), (D, D)) * 0.5, logical_axes=("embed", "mlp"))
        self.lm_head = nnx.Param(jax.random.normal(rngs.params(), (D, V)) * 0.5, logical_axes=("embed", "vocab"))

    def __call__(self, tokens, positions, segment_ids):
        h = jnp.tanh(self.embed[...][tokens] @ self.w[...])
        return h @ self.lm_head[...], {}


def test_bfloat16_grad_accumulation_is_close_to_float32_and_rejects_other_dtypes(tmp_path):
    batch = make_batch(4)
    out = {}
    for dt in ("float32", "bfloat16"):
        tr = make_trainer(tmp_path / dt, make_config(grad_accum=4, grad_accum_dtype=dt))
        m = tr.train_step(batch)
        out[dt] = (float(m["grad_norm"]), jax.tree.map(np.asarray, nnx.to_pure_dict(tr.params)))
        tr.close()
    (g32, p32), (g16, p16) = out["float32"], out["bfloat16"]
    assert g16 != g32  # the sums were rounded to bfloat16 ...
    np.testing.assert_allclose(g16, g32, rtol=2e-2)  # ... to its precision
    # Adam moves each weight by about lr whatever the gradient's size: a near-zero gradient
    # element may flip sign when rounded; the rest agree
    diff = np.concatenate([np.abs(a - b).ravel() for a, b in zip(jax.tree.leaves(p32), jax.tree.leaves(p16))])
    assert (diff > 1e-3).mean() < 0.01 and diff.max() <= 2.05e-2
    with pytest.raises(ValueError, match="train.grad_accum_dtype='float16'"):
        make_trainer(tmp_path / "bad", make_config(grad_accum_dtype="float16"))


def _sharded_after_two_steps(path, **train):
    """(config, trainer) of ShardedToy on a data 2 x fsdp 4 mesh with `train` keys, after steps on
    batches 0 and 1."""
    cfg = make_config(**train)
    cfg.mesh.data, cfg.mesh.fsdp = 2, 4
    tr = make_trainer(path, cfg, model_fn=lambda: ShardedToy(nnx.Rngs(0)))
    tr.train_step(make_batch(0))
    tr.train_step(make_batch(1))
    return cfg, tr


def test_optimizer_over_data_splits_the_moments_over_replicas_and_matches(tmp_path):
    """train.optimizer_over_data (ZeRO-1 over `data`): moments split over data x fsdp, the step
    equal to the replicated optimizer's."""
    from coder.train.flat import tree_to_flat

    out = {}
    for over in (False, True):
        _, tr = _sharded_after_two_steps(tmp_path / str(over), optimizer_over_data=over)

        specs = {n: leaf.sharding.spec for n, leaf in tree_to_flat(tr.opt_state).items()
                 if n.endswith(".w.value") and leaf.ndim == 2}
        out[over] = (specs, jax.tree.map(np.asarray, nnx.to_pure_dict(tr.params)))
        tr.close()
    assert set(out[False][0].values()) == {jax.sharding.PartitionSpec("fsdp", "tensor")}
    assert set(out[True][0].values()) == {jax.sharding.PartitionSpec(("data", "fsdp"), "tensor")}
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 out[False][1], out[True][1])


def test_offload_optimizer_keeps_the_moments_in_host_memory_and_steps_alike(tmp_path):
    """train.offload_optimizer: between steps every optimizer-state array sits in pinned host
    memory (the step moves it to the devices for the update and back); the parameters equal the
    on-device optimizer's bit for bit; a checkpoint of the host-resident state resumes to the
    same next step."""
    from coder.train.flat import tree_to_flat

    out = {}
    for offload in (False, True):
        cfg, tr = _sharded_after_two_steps(tmp_path / str(offload), offload_optimizer=offload)
        kinds = {leaf.sharding.memory_kind for leaf in tree_to_flat(tr.opt_state).values()}
        tr.save(force=True)
        tr.close()
        resumed = make_trainer(tmp_path / str(offload), cfg, model_fn=lambda: ShardedToy(nnx.Rngs(0)))
        assert resumed.step == 2
        assert {leaf.sharding.memory_kind for leaf in tree_to_flat(resumed.opt_state).values()} == kinds
        resumed.train_step(make_batch(2))
        out[offload] = (kinds, jax.tree.map(np.asarray, nnx.to_pure_dict(resumed.params)))
        resumed.close()
    assert out[True][0] == {"pinned_host"} and "pinned_host" not in out[False][0]
    jax.tree.map(np.testing.assert_array_equal, out[False][1], out[True][1])


@pytest.mark.slow
def test_params_over_data_splits_the_parameters_and_gathers_the_bf16_copy_once(tmp_path):
    """train.params_over_data (Kimi K2's two-slice setting, with reduce_grads_once and
    cast_params_once): the float32 parameters split over data x fsdp like their moments, the
    bf16 copy constrained back to the rules' shardings (gathered over data) before the
    micro-batch loop, and the steps equal ZeRO-1's (optimizer_over_data alone)."""
    from coder.model import sharding
    from coder.train.flat import tree_to_flat

    out = {}
    for over in (False, True):
        cfg = make_config(grad_accum=2, reduce_grads_once=True, cast_params_once=True,
                          optimizer_over_data=True, params_over_data=over)
        cfg.model.dtype = "bfloat16"
        cfg.mesh.data, cfg.mesh.fsdp = 2, 4
        tr = make_trainer(tmp_path / str(over), cfg, model_fn=lambda: ShardedToy(nnx.Rngs(0)))
        losses_seen = [float(tr.train_step(make_batch(i))["loss"]) for i in range(2)]
        specs = {n: leaf.sharding.spec for n, leaf in tree_to_flat(tr.params).items()}
        with sharding.activate(tr.mesh, tr.rules):
            text = tr._jit_step.lower(tr.params, tr.rest, tr.opt_state, jnp.asarray(0, jnp.int32),
                                      tr.device_batch(make_batch(0))).as_text()
        gathered = [ln for ln in text.splitlines() if "sharding_constraint" in ln and "16xbf16>" in ln]
        out[over] = (losses_seen, specs, gathered, jax.tree.map(np.asarray, nnx.to_pure_dict(tr.params)))
        tr.save(force=True)
        tr.close()
    # a resumed run restores the split parameters into the split layout
    tr = make_trainer(tmp_path / "True", cfg, model_fn=lambda: ShardedToy(nnx.Rngs(0)))
    assert tr.step == 2 and tr.params["w"][...].sharding.spec == jax.sharding.PartitionSpec(("data", "fsdp"), "tensor")
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, nnx.to_pure_dict(tr.params)), out[True][3])
    tr.close()
    assert out[False][1]["w.value"] == jax.sharding.PartitionSpec("fsdp", "tensor")
    assert out[True][1]["w.value"] == jax.sharding.PartitionSpec(("data", "fsdp"), "tensor")
    assert not out[False][2]
    assert any('[{"fsdp"}, {"tensor"}]> : tensor<16x16xbf16>' in ln for ln in out[True][2])
    np.testing.assert_allclose(out[True][0], out[False][0], rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), out[False][3], out[True][3])


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_bfloat16_first_moment(tmp_path, optimizer):
    from coder.train.flat import tree_to_flat

    tr = make_trainer(tmp_path, make_config(optimizer=optimizer, mu_dtype="bfloat16"))
    m = tr.train_step(make_batch(0))
    assert np.isfinite(float(m["loss"]))
    dtypes = {n: leaf.dtype for n, leaf in tree_to_flat(tr.opt_state).items() if leaf.ndim == 2}
    mu = [d for n, d in dtypes.items() if ".mu." in n]
    assert mu and all(d == jnp.bfloat16 for d in mu)  # the first moment ...
    assert any(d == jnp.float32 for n, d in dtypes.items() if ".nu." in n)  # ... only
    tr.close()
    with pytest.raises(ValueError, match="train.mu_dtype='float16'"):
        make_trainer(tmp_path / "bad", make_config(mu_dtype="float16"))


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_optimizer_state_shards_like_params(tmp_path, optimizer):
    cfg = make_config(optimizer=optimizer)
    cfg.mesh.data, cfg.mesh.fsdp = 2, 4  # embed -> fsdp (4 ways), batch -> data x fsdp
    tr = make_trainer(tmp_path, cfg, model_fn=lambda: ShardedToy(nnx.Rngs(0)))
    tr.train_step(make_batch(0))  # the step's out_shardings keep the layout
    specs = {k: v.sharding.spec for k, v in nnx.to_flat_state(tr.params)}
    assert specs[("w",)] == jax.sharding.PartitionSpec("fsdp", "tensor")
    from coder.train.flat import tree_to_flat

    matched = 0
    for name, leaf in tree_to_flat(tr.opt_state).items():
        for pname in ("embed", "w", "lm_head"):
            if name.endswith(f".{pname}.value") and leaf.shape == tr.params[pname][...].shape:
                assert leaf.sharding.spec == tr.params[pname][...].sharding.spec, name
                matched += 1
    assert matched >= 3  # at least one moment per matrix is sharded like its parameter
    tr.close()


# ----------------------------------------------------------------------------- real model
@pytest.mark.slow
@pytest.mark.parametrize("remat", ["none", "full"])
def test_transformer_with_remat_trains_under_accumulation(tmp_path, remat):
    """The real MoE model through the trainer's scanned micro-batch step, with and without
    rematerialisation: same losses (remat changes memory, never the maths)."""

    c = make_config(grad_accum=2, steps=2)
    c.model.update(dict(vocab_size=V, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                        num_hidden_layers=2, num_attention_heads=2, kv_lora_rank=8, qk_nope_head_dim=4,
                        qk_rope_head_dim=4, v_head_dim=4, n_routed_experts=4, n_group=1, topk_group=1,
                        num_experts_per_tok=2, num_mtp_layers=1, dtype="float32", remat=remat))
    trainer = make_trainer(tmp_path / remat, c, model_fn=None)  # config.seed 0
    losses_seen = [float(trainer.train_step(make_batch(i))["loss"]) for i in range(2)]
    trainer.close()
    expected = getattr(test_transformer_with_remat_trains_under_accumulation, "losses", None)
    if expected is None:
        test_transformer_with_remat_trains_under_accumulation.losses = losses_seen
    else:
        np.testing.assert_allclose(losses_seen, expected, rtol=1e-5)
    assert all(np.isfinite(losses_seen))


def _tiny_moe(c, **extra):
    """Two layers (the first dense unless model.first_k_dense_replace says otherwise), no MTP module
    (compiling is most of these tests' cost)."""
    c.model.update(dict(vocab_size=V, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                        num_hidden_layers=2, num_attention_heads=2, kv_lora_rank=8, qk_nope_head_dim=4,
                        qk_rope_head_dim=4, v_head_dim=4, n_routed_experts=4, n_group=1, topk_group=1,
                        num_experts_per_tok=2, num_mtp_layers=0, dtype="float32", **extra))
    return c


@pytest.mark.slow
def test_reduce_grads_once_equals_the_per_micro_batch_reduction(tmp_path):
    """train.reduce_grads_once: the real MoE model on data 2 x fsdp 2 x expert 2 (its sharding
    constraints and the MoE's shard_map run inside the vmap over `data`) takes the same steps
    as the default reduction; parameters sharded over `data` are refused by name."""
    from coder.model import sharding

    out = {}
    for once in (False, True):
        c = _tiny_moe(make_config(grad_accum=2, reduce_grads_once=once))
        c.mesh.update(dict(data=2, fsdp=2, expert=2))
        tr = make_trainer(tmp_path / str(once), c, model_fn=None)  # config.seed 0
        ms = [tr.train_step(make_batch(0))]
        with sharding.activate(tr.mesh, tr.rules):
            hlo = tr._jit_step.lower(tr.params, tr.rest, tr.opt_state, jnp.asarray(0, jnp.int32),
                                     tr.device_batch(make_batch(0))).as_text(debug_info=True)
        assert ("vmap(" in hlo) == once  # the per-replica gradients were traced
        out[once] = ([(float(m["loss"]), float(m["grad_norm"]), float(m["load_imbalance"])) for m in ms],
                     jax.tree.map(np.asarray, nnx.to_pure_dict(tr.params)))
        tr.close()
    np.testing.assert_allclose(out[True][0], out[False][0], rtol=2e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), out[False][1], out[True][1])

    c = make_config(grad_accum=2, reduce_grads_once=True)
    c.mesh.update(dict(data=2, fsdp=4))
    c.mesh.rules = tuple((k, ("data", "fsdp") if k == "embed" else v) for k, v in c.mesh.rules)
    tr = make_trainer(tmp_path / "bad", c, model_fn=lambda: ShardedToy(nnx.Rngs(0)))
    with pytest.raises(ValueError, match="parameter sharded over mesh.data"):
        tr.train_step(make_batch(0))
    tr.close()


@pytest.mark.slow
def test_cast_params_once_takes_gradients_in_the_model_dtype(tmp_path):
    """train.cast_params_once: the bf16 model's matrices are cast once per step (router, embedding
    and norm scales stay float32), the micro-batch loop differentiates the bf16 copy, and on one
    device the steps equal the default's."""
    from coder.train.trainer import compute_copy

    out = {}
    for once in (False, True):
        c = _tiny_moe(make_config(grad_accum=2, cast_params_once=once))
        c.model.dtype = "bfloat16"
        tr = make_trainer(tmp_path / str(once), c, model_fn=None)  # config.seed 0
        tr.train_step(make_batch(0))
        out[once] = jax.tree.map(np.asarray, nnx.to_pure_dict(tr.params))  # after the update
        jaxpr = jax.make_jaxpr(tr._step)(tr.params, tr.rest, tr.opt_state, jnp.asarray(0, jnp.int32),
                                         tr.device_batch(make_batch(0)))
        (loop,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
        # the micro-batch loop takes the bf16 copy of lm_head [16, 32] (or the float32 parameter)
        assert ("bfloat16[16,32]" in str([v.aval for v in loop.invars])) == once
        if once:
            copy = dict(nnx.to_flat_state(compute_copy(tr.params, jnp.bfloat16)))
            dtypes = {".".join(map(str, k)): v[...].dtype for k, v in copy.items()}
            grads = jax.grad(lambda p: jnp.sum(p["lm_head"][...].astype(jnp.float32)))(
                compute_copy(tr.params, jnp.bfloat16))
            assert grads["lm_head"][...].dtype == jnp.bfloat16
        tr.close()
    assert dtypes["embed"] == dtypes["layers.1.mlp.router"] == jnp.float32  # float32_compute
    assert dtypes["norm.weight"] == jnp.float32  # vectors
    assert dtypes["lm_head"] == dtypes["layers.1.mlp.wg"] == dtypes["layers.0.self_attn.o_proj"] == jnp.bfloat16
    # on one device the float32 gradient of a cast is the bf16 one, converted: the same sums
    jax.tree.map(np.testing.assert_array_equal, out[True], out[False])


@pytest.mark.slow
def test_build_model_compiles_a_configs_initialiser_once():
    """state.build_model: one compiled initialiser per (model config, mesh, rules), the seed its
    argument; the parameters are those of Transformer(config.model, nnx.Rngs(seed)) bit for bit,
    and a config changed after a build gets a program of its own."""
    from coder.model import Transformer
    from coder.train import state as state_lib

    c = _tiny_moe(make_config())
    flat = lambda m: {"/".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(m))}
    a, b = state_lib.build_model(c, seed=3), state_lib.build_model(c, seed=4)
    _, init = state_lib._transformer_init(c.model, state_lib.sharding.make_mesh(c.mesh), state_lib.rules_of(c))
    assert init._cache_size() == 1  # both seeds ran one program
    want = flat(state_lib.build_model(c, model_fn=lambda: Transformer(c.model, rngs=nnx.Rngs(3))))
    got, other = flat(a), flat(b)
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert not np.array_equal(got["lm_head"], other["lm_head"])
    c.model.hidden_size = 24
    assert state_lib.build_model(c, seed=3).lm_head[...].shape == (24, V)
