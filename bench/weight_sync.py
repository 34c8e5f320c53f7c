"""Weight store (coder/rl/weight_sync.py) on real GRPO-sized updates: bytes per version against
the full serving-dtype weights, seconds per publish and per load.

    python bench/weight_sync.py [--config configs/quickstart.py] [--lr 1e-6 3e-6] [--steps 4]
                                [--dtype bfloat16] [--anchor_every 10] [--model hidden_size=512 ...]

The config's model (float32 master weights, the seeded initialisation) takes `--steps` optimizer
steps of the project's optimizer (coder.train.optim.make_optimizer: AdamW, b1 0.9, b2 0.95, weight
decay 0.1, global-norm clipping 1; constant lr) on the GRPO loss (coder.rl.grpo.policy_loss,
on-policy, every token a policy token, a random advantage per row) of random tokens. After
each step the weights are cast to the serving dtype and published as the next version to a
local directory; version 0 (the start) is an anchor, the rest deltas. Per version it prints the
bytes written / the full serving-dtype bytes, the share of elements whose serving-dtype bits
changed, publish seconds, a reader's poll (apply one delta) seconds, and a fresh load's (anchor
+ every delta since) seconds; then the delta codec on the first update without byte planes and
at other zstd levels.

    python bench/weight_sync.py --processes 1 2 4 [--mb 256] [--versions 4] [--changed 0.02] [--chunk_kb 128]

The sharded store instead: for each writer count N, a jax.distributed job of N processes on
localhost (8 CPU devices in all, 8/N each) holds a bf16 state of `--mb` MB split by rows over
the 8 devices (the learner's FSDP-like layout); each process publishes its own devices' slices
(weight_sync.local_slices; version 0 an anchor, then deltas with `--changed` of the elements
moved) and reads every version back split by columns over a (4, 2) mesh (an engine's
tensor-parallel layout: every reader needs a piece of every writer's slices). Per process and
version it prints bytes written and publish seconds, bytes read and load seconds, and checks
every shard it read bit for bit.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import zstandard  # noqa: E402
from flax import nnx  # noqa: E402

from coder.model import Transformer  # noqa: E402
from coder.rl import grpo, weight_sync  # noqa: E402
from coder.train.flat import state_to_flat  # noqa: E402
from coder.train.optim import make_optimizer  # noqa: E402


def _config(path: str, overrides: list[str]):
    spec = importlib.util.spec_from_file_location("bench_config", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    c = mod.get_config()
    for kv in overrides:
        k, v = kv.split("=", 1)
        c.model[k] = type(c.model[k])(v)
    return c


def _serving(params: nnx.State, dtype) -> dict:
    return {k: np.asarray(v).astype(dtype) for k, v in state_to_flat(params).items()}


def run(args) -> None:
    c = _config(args.config, args.model)
    c.train.update(dict(lr=args.lr, warmup_steps=0, min_lr_ratio=1.0, steps=10 ** 6))
    dtype = np.dtype(getattr(ml_dtypes, args.dtype, None) or args.dtype)
    model = Transformer(c.model, rngs=nnx.Rngs(int(c.seed)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = make_optimizer(c.train)
    opt = tx.init(params)
    b, t = int(c.data.batch_size), min(int(c.data.seq_len), 256)

    @jax.jit
    def step(params, opt, tokens, adv):
        def loss(p):  # the GRPO loss, on-policy: behaviour = reference = the current model
            segs = jnp.ones((b, t), jnp.int32)
            logits, _ = nnx.merge(graphdef, p, rest)(tokens, jnp.broadcast_to(jnp.arange(t), (b, t)),
                                                     segs, mtp=False)
            logp, _, valid = grpo.target_logp(logits, tokens, segs)
            old = jax.lax.stop_gradient(logp)
            return grpo.policy_loss(logp, old, old, adv, valid, clip_low=0.2, clip_high=0.28,
                                    kl_coef=0.001, normalizer=float(b * t))[0]

        g = jax.grad(loss)(params)
        updates, opt = tx.update(g, opt, params)
        return jax.tree.map(lambda p, u: p + u, params, updates), opt

    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    print(f"model {os.path.basename(args.config)} {dict((kv.split('=') for kv in args.model))}: "
          f"{n_params / 1e6:.2f}M params, serving dtype {dtype.name}, lr {args.lr:g}, "
          f"anchor_every {args.anchor_every}")
    url = os.path.join(tempfile.mkdtemp(), "store")
    pub = weight_sync.WeightPublisher(url, anchor_every=args.anchor_every)
    reader = weight_sync.WeightReader(url)
    rng = np.random.default_rng(0)
    prev, first_delta = None, None
    print(f"{'version':>7} {'kind':>6} {'bytes':>11} {'/ full':>8} {'changed':>8} {'publish s':>10} "
          f"{'poll s':>8} {'load s':>8}")
    for v in range(args.steps + 1):
        if v:
            tokens = jnp.asarray(rng.integers(0, int(c.model.vocab_size), (b, t)), jnp.int32)
            adv = jnp.asarray(rng.normal(size=(b,)), jnp.float32)  # one rollout per row
            params, opt = step(params, opt, tokens, adv)
        flat = _serving(params, dtype)
        info = pub.publish(v, flat)
        t0 = time.perf_counter()
        got_v, got = reader.poll()
        poll_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        weight_sync.load(url, v)
        load_s = time.perf_counter() - t0
        assert got_v == v and all(got[k].tobytes() == flat[k].tobytes() for k in flat)
        changed = "-"
        if prev is not None:
            n_changed = sum(int((flat[k].reshape(-1).view(np.uint8).reshape(flat[k].size, -1)
                                 != prev[k].reshape(-1).view(np.uint8).reshape(prev[k].size, -1)).any(-1).sum())
                            for k in flat)
            changed = f"{n_changed / n_params:.2%}"
            if first_delta is None:
                first_delta = (prev, flat)
        kind = "anchor" if info["delta_leaves"] == 0 else "delta"
        print(f"{v:>7} {kind:>6} {info['bytes']:>11,} {info['bytes'] / info['raw_bytes']:>8.2%} "
              f"{changed:>8} {info['seconds']:>10.4f} {poll_s:>8.4f} {load_s:>8.4f}")
        prev = flat
    if first_delta is not None:
        prev, flat = first_delta
        full = sum(x.nbytes for x in flat.values())
        print("delta codec on the first update (bytes / full):")
        for level in (1, 3, 9):
            for planes in (False, True):
                total = 0
                for k in flat:
                    xor = np.bitwise_xor(flat[k].reshape(-1).view(np.uint8), prev[k].reshape(-1).view(np.uint8))
                    if planes:
                        xor = weight_sync._planes(xor, flat[k].dtype.itemsize)
                    total += len(zstandard.ZstdCompressor(level=level).compress(xor.tobytes()))
                print(f"  zstd level {level} {'byte planes' if planes else 'interleaved'}: {total / full:.2%}")


def sharded_worker(args) -> None:
    """One process of an N-process job: publish `args.versions` versions of its slices, read each
    back in the reader's sharding, print one JSON line of per-version figures."""
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    if args.num_processes > 1:
        jax.distributed.initialize(coordinator_address=f"localhost:{args.port}",
                                   num_processes=args.num_processes, process_id=args.process_id)
    devices = np.array(jax.devices())
    write = NamedSharding(Mesh(devices.reshape(2, 4), ("a", "b")), P(("a", "b"), None))
    read = NamedSharding(Mesh(devices.reshape(4, 2), ("x", "y")), P(None, ("x", "y")))
    cols, leaves = 1024, 8
    rows = max(8, int(args.mb * 2 ** 20 / (leaves * cols * 2)) // 8 * 8)
    rng = np.random.default_rng(0)  # the same values in every process: the job's one state
    host = {f"layer{i}": rng.normal(0, 0.02, (rows, cols)).astype(ml_dtypes.bfloat16) for i in range(leaves)}
    pub = weight_sync.WeightPublisher(args.url, shard=(jax.process_index(), jax.process_count()))
    reader = weight_sync.WeightReader(args.url, shardings={k: read for k in host})
    out = []
    for v in range(args.versions):
        if v:
            for k, x in host.items():
                hit = rng.random(x.shape) < args.changed
                host[k] = np.where(hit, x.astype(np.float32) * 1.01 + 1e-3, x.astype(np.float32)).astype(x.dtype)
        state = {k: jax.make_array_from_callback(x.shape, write, lambda i, x=x: x[i]) for k, x in host.items()}
        info = pub.publish(v, weight_sync.local_slices(state, chunk_bytes=int(args.chunk_kb * 1024)))
        multihost_utils.sync_global_devices(f"published {v}")
        t0 = time.perf_counter()
        got_v, got = reader.poll()
        load_s = time.perf_counter() - t0
        exact = got_v == v and all(np.asarray(sh.data).tobytes() == host[k][sh.index].tobytes()
                                   for k in host for sh in got[k].addressable_shards)
        out.append({"version": v, "written": info["bytes"], "raw": info["raw_bytes"],
                    "publish_s": info["seconds"], "read": reader.last_read["bytes"],
                    "held": reader.last_read["held_bytes"], "load_s": load_s, "exact": exact,
                    "total": sum(x.nbytes for x in host.values())})
        multihost_utils.sync_global_devices(f"read {v}")
    print("SHARDED " + json.dumps(out), flush=True)


def _read(f) -> str:
    f.seek(0)
    return f.read()


def sharded(args) -> None:
    """Spawns each N-process job and prints its per-process, per-version table."""
    for n in args.processes:
        if 8 % n:
            raise SystemExit(f"--processes {n}: 8 devices must split evenly over the processes")
        with socket.socket() as s:
            s.bind(("localhost", 0))
            port = s.getsockname()[1]
        url = os.path.join(tempfile.mkdtemp(), "store")
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // n}")
        # files, not pipes: the processes run together while this reads one at a time, and an
        # unread pipe's writer blocks (with its job's collectives) once 64 KiB are buffered
        logs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in range(n)]
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", "--url", url, "--port", str(port),
                                   "--num_processes", str(n), "--process_id", str(i), "--mb", str(args.mb),
                                   "--versions", str(args.versions), "--changed", str(args.changed),
                                   "--chunk_kb", str(args.chunk_kb)],
                                  env=env, stdout=logs[i][0], stderr=logs[i][1], text=True)
                 for i in range(n)]
        results = []
        for i, p in enumerate(procs):
            p.wait(timeout=1800)
            stdout, stderr = (_read(f) for f in logs[i])
            if p.returncode:
                raise SystemExit(f"process {i} of {n} failed:\n{stderr[-3000:]}")
            results.append(json.loads(next(x for x in stdout.splitlines() if x.startswith("SHARDED "))[8:]))
        total = results[0][0]["total"]
        print(f"{n} writer process(es), {total / 2 ** 20:.0f} MiB bf16 state, rows over 8 devices -> "
              f"read as columns over a (4, 2) mesh, chunks <= {args.chunk_kb:g} KiB")
        print(f"{'proc':>4} {'version':>7} {'written':>12} {'/ model':>8} {'publish s':>10} {'read':>12} "
              f"{'/ model':>8} {'load s':>8} {'exact':>6}")
        for i, rows in enumerate(results):
            for r in rows:
                print(f"{i:>4} {r['version']:>7} {r['written']:>12,} {r['written'] / total:>8.2%} "
                      f"{r['publish_s']:>10.3f} {r['read']:>12,} {r['read'] / total:>8.2%} {r['load_s']:>8.3f} "
                      f"{str(r['exact']):>6}")
        if not all(r["exact"] for rows in results for r in rows):
            raise SystemExit("a reader's shards differ from what was published")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "..", "configs", "quickstart.py"))
    ap.add_argument("--lr", type=float, nargs="+", default=[1e-6, 3e-6])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--anchor_every", type=int, default=10)
    ap.add_argument("--model", nargs="*", default=[], help="model config overrides key=value")
    ap.add_argument("--processes", type=int, nargs="*", default=[],
                    help="the sharded store instead: writer process counts (e.g. 1 2 4)")
    ap.add_argument("--mb", type=float, default=256, help="sharded: the state's size in MB (bf16)")
    ap.add_argument("--versions", type=int, default=4, help="sharded: versions published (0 = anchor)")
    ap.add_argument("--changed", type=float, default=0.02, help="sharded: share of elements moved per version")
    ap.add_argument("--chunk_kb", type=float, default=128,
                    help="sharded: slice chunk cap (weight_sync.local_slices; the store's default is 64 MiB, "
                         "sized for multi-GB shards: keep chunk / shard about as at scale)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--num_processes", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--process_id", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return sharded_worker(args)
    if args.processes:
        return sharded(args)
    for lr in args.lr:
        run(argparse.Namespace(**{**vars(args), "lr": lr}))


if __name__ == "__main__":
    main()
