"""Host memory of importing a Hugging Face checkpoint (coder.model.hf_import.import_into).

Writes a DeepSeek-V3-layout checkpoint of a ~100M-parameter MoE (float32, ~400 MB, in shards of
--shard_mb) with save_hf, then, in a fresh process, builds the model the way a stage does
(coder.train.state.build_model: created in its sharding on the mesh, randomly initialised) and
imports the checkpoint into it (coder.train.state.load_into). It prints the resident set size
(RSS) of that process: after the imports of the libraries, after the model is built, and the peak
while importing (VmHWM, reset just before the import: /proc/self/clear_refs; the random init's
freed temporaries returned to the OS first, malloc_trim), next to the model's and the largest
shard's bytes. The import's promise: peak <= built model + one shard
(the blocks in flight and the mapped pages of the shards being read), never the whole checkpoint
a second time.

    python bench/hf_import.py [--shard_mb 100] [--devices 8] [--dir /tmp/coder_bench_hf]

--devices N runs the import on N fake CPU devices with the experts split over them (every
process reads only its devices' blocks; on one host all devices share its memory).
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def model_cfg():
    from configs.base import model_config

    m = model_config()
    m.update(dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, moe_intermediate_size=512,
                  num_hidden_layers=8, num_attention_heads=8, kv_lora_rank=128, qk_nope_head_dim=64,
                  qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=16, num_experts_per_tok=2,
                  n_group=4, topk_group=2, num_mtp_layers=1, dtype="float32"))
    return m


def _rss(field: str) -> int:
    """Bytes of a /proc/self/status field (VmRSS: now, VmHWM: the peak since the last reset)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def make(directory: str, shard_mb: int) -> None:
    from flax import nnx

    from coder.model import Transformer
    from coder.model.hf_export import save_hf

    cfg = model_cfg()
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    save_hf(cfg, model, directory, max_shard_bytes=shard_mb << 20)


def measure(directory: str, devices: int) -> dict:
    import jax

    from coder.train import state as state_lib
    from configs.base import get_config

    c = get_config()
    c.model = model_cfg()
    c.mesh.update(dict(data=-1, expert=min(devices, 16)) if devices > 1 else dict(data=-1))
    if devices > 1:
        c.mesh.update(dict(data=devices // min(devices, 16)))
    rss_libs = _rss("VmRSS")
    model = state_lib.build_model(c)
    jax.block_until_ready(jax.tree.leaves(state_lib.nnx.state(model)))
    peak_build = _rss("VmHWM")
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # the init's freed temporaries back to the OS
    rss_built = _rss("VmRSS")
    built_anon, built_file = _rss("RssAnon"), _rss("RssFile")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    peaks = {"RssAnon": 0, "RssFile": 0}
    done = threading.Event()

    def sample():  # the anonymous / file-mapped split of the peak, every 2 ms
        while not done.is_set():
            for k in peaks:
                peaks[k] = max(peaks[k], _rss(k))
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    t0 = time.perf_counter()
    report = state_lib.load_into(model, directory)
    jax.block_until_ready(jax.tree.leaves(state_lib.nnx.state(model)))
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    peak = _rss("VmHWM")
    leaves = jax.tree.leaves(state_lib.nnx.state(model))
    model_bytes = sum(x.nbytes for x in leaves)
    host_bytes = sum(s.data.nbytes for x in leaves for s in x.addressable_shards)  # replicas included
    return dict(devices=jax.device_count(), rss_libs=rss_libs, peak_build=peak_build, rss_built=rss_built,
                peak=peak, peak_anon=peaks["RssAnon"], peak_file=peaks["RssFile"],
                built_anon=built_anon, built_file=built_file,
                host_bytes=host_bytes, largest_var=max(s.data.nbytes for x in leaves for s in x.addressable_shards),
                rss_after=_rss("VmRSS"), model_bytes=model_bytes, seconds=seconds,
                fresh_mtp=report["fresh_mtp"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/coder_bench_hf")
    ap.add_argument("--shard_mb", type=int, default=100)
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--_measure", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._measure:
        print(json.dumps(measure(args.dir, args.devices)))
        return
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    if not os.path.exists(os.path.join(args.dir, "model.safetensors.index.json")):
        subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {ROOT!r}); "
                        f"from bench.hf_import import make; make({args.dir!r}, {args.shard_mb})"],
                       env=env, check=True)
    shards = [os.path.getsize(os.path.join(args.dir, f)) for f in os.listdir(args.dir) if f.endswith(".safetensors")]
    out = subprocess.run([sys.executable, __file__, "--_measure", "--dir", args.dir, "--devices", str(args.devices)],
                         env=env, check=True, capture_output=True, text=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    mb = lambda b: f"{b / 2**20:,.0f} MB"  # noqa: E731
    print(f"checkpoint {mb(sum(shards))} in {len(shards)} shards (largest {mb(max(shards))}); "
          f"model {mb(r['model_bytes'])} float32 on {r['devices']} device(s), {mb(r['host_bytes'])} with the replicas "
          "(CPU devices: all in this process's memory)")
    print(f"RSS: libraries {mb(r['rss_libs'])}, model built {mb(r['rss_built'])} (peak of the "
          f"build {mb(r['peak_build'])}), peak while importing {mb(r['peak'])} (sampled: anonymous "
          f"{mb(r['peak_anon'])}, file-mapped {mb(r['peak_file'])}), after {mb(r['rss_after'])}; "
          f"import {r['seconds']:.1f} s")
    over = r["peak"] - r["rss_built"]
    anon, mapped = r["peak_anon"] - r["built_anon"], r["peak_file"] - r["built_file"]
    print(f"import overhead over the built model: {mb(over)} = {over / max(shards):.2f} x the largest shard "
          f"({over / sum(shards):.2f} x the checkpoint): file-mapped pages of the shard being read "
          f"{mb(mapped)} ({mapped / max(shards):.2f} x the largest shard), anonymous {mb(anon)} "
          f"({anon / r['largest_var']:.1f} x the largest block of a variable on a device, {mb(r['largest_var'])}); "
          f"fresh MTP modules: {r['fresh_mtp']}")


if __name__ == "__main__":
    main()
