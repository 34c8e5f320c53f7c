"""coder.model.hf_export.save_hf to a store URL (gs://...; here memory://, through fsspec as gs://)."""
import os
import types
import uuid

import fsspec
import numpy as np
from flax import nnx

from coder.model import Transformer, hf_export, hf_import


def test_save_hf_writes_to_an_fsspec_url(tmp_path, monkeypatch, export_cfg):
    """The checkpoint lands in the store, not in a local directory named `memory:` (or `gs:`),
    and reads back as the same parameters."""
    cfg = export_cfg()
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tok = types.SimpleNamespace(bos_id=1, eos_id=2, files=lambda: {"tokenizer.model": b"sp-bytes"})
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    url = f"memory://hf-export-{uuid.uuid4().hex}/ckpt"
    fs = fsspec.filesystem("memory")
    try:
        hf_export.save_hf(cfg, model, url, max_shard_bytes=20_000, tokenizer=tok)
        assert not os.listdir(tmp_path / "work")  # nothing local
        names = {os.path.basename(p) for p in fs.ls(url, detail=False)}
        assert {"config.json", hf_import.INDEX, "tokenizer.model", "model-00001.safetensors"} <= names
        assert fs.cat_file(f"{url}/tokenizer.model") == b"sp-bytes"
        fs.get(f"{url}/", str(tmp_path / "local") + "/", recursive=True)
    finally:
        if fs.exists(url):
            fs.rm(url.rsplit("/", 1)[0], recursive=True)
    _, back = hf_import.load_hf(str(tmp_path / "local"))
    a, b = dict(nnx.to_flat_state(nnx.state(model))), dict(nnx.to_flat_state(nnx.state(back)))
    assert a.keys() == b.keys()
    for p in a:
        np.testing.assert_array_equal(np.asarray(a[p].get_value()), np.asarray(b[p].get_value()), err_msg=str(p))
