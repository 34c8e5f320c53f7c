"""coder.model.hf_import against transformers' DeepseekV3ForCausalLM (float32, CPU torch)."""
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from coder.model import Transformer  # noqa: E402
from coder.model import hf_export, hf_import  # noqa: E402

BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
            num_hidden_layers=3, num_attention_heads=4, kv_lora_rank=16, qk_nope_head_dim=8,
            qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=64,
            rms_norm_eps=1e-6, rope_theta=10000.0, num_nextn_predict_layers=0)
CASES = {
    # dense + MoE layers, no q compression, group-limited routing (2 of 4 groups), plain RoPE
    "groups_noqlora": dict(q_lora_rank=None, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                           norm_topk_prob=True),
    # q compression, YaRN with DeepSeek's softmax-scale correction, unnormalised top-k
    "qlora_yarn": dict(q_lora_rank=12, n_group=2, topk_group=1, routed_scaling_factor=1.5,
                       norm_topk_prob=False,
                       rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=16,
                                         beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=0.8)),
}


def _hf_model(case, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.DeepseekV3Config(**BASE, **CASES[case])
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():  # larger-than-default weights so differences would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.copy_(0.1 * torch.randn(cfg.n_routed_experts))
    return model


def _tokens(seed=1, b=2, t=24, v=96):
    return np.random.RandomState(seed).randint(0, v, size=(b, t)).astype(np.int32)


def _ours(model, tokens):
    b, t = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    logits, aux = model(jnp.asarray(tokens), pos, jnp.ones((b, t), jnp.int32))
    return np.asarray(logits), aux


def _theirs(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c == "groups_noqlora" else c
                                  for c in sorted(CASES)])  # groups_noqlora: 15 s
def test_import_matches_transformers_and_round_trips(case, tmp_path):
    hf = _hf_model(case)
    hf.save_pretrained(tmp_path / "hf")
    cfg, model = hf_import.load_hf(str(tmp_path / "hf"), dtype=jnp.float32)
    assert cfg.q_lora_rank == (CASES[case]["q_lora_rank"] or 0)
    tokens = _tokens()
    ref = _theirs(hf, tokens)
    ours, aux = _ours(model, tokens)
    assert aux["router_load"].shape == (2, 8)
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
    assert np.abs(ref).max() > 1.0  # the comparison is not between near-zero logits

    # export -> transformers -> the same logits
    hf_export.save_hf(cfg, model, str(tmp_path / "ours"))
    hf2 = transformers.DeepseekV3ForCausalLM.from_pretrained(
        str(tmp_path / "ours"), attn_implementation="eager").eval()
    np.testing.assert_allclose(_theirs(hf2, tokens), ref, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_mtp_layers_round_trip(tmp_path, export_cfg):
    cfg = export_cfg(2)
    model = Transformer(cfg, rngs=nnx.Rngs(3))
    hf_export.save_hf(cfg, model, str(tmp_path))
    names = set(json.load(open(tmp_path / "model.safetensors.index.json"))["weight_map"])
    for k in range(2):  # MTP modules are layers num_hidden_layers + k, DeepSeek-V3 names
        for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                  "self_attn.kv_b_proj.weight", "mlp.experts.3.down_proj.weight"):
            assert f"model.layers.{2 + k}.{n}" in names
    cfg2, model2 = hf_import.load_hf(str(tmp_path))
    assert cfg2.num_mtp_layers == 2
    a = dict(nnx.to_flat_state(nnx.state(model)))
    b = dict(nnx.to_flat_state(nnx.state(model2)))
    assert a.keys() == b.keys()
    for p in a:
        np.testing.assert_array_equal(np.asarray(a[p].get_value()), np.asarray(b[p].get_value()), err_msg=str(p))
    # loading straight into a sharded layout: experts split over the expert axis
    from coder.model import sharding

    mcfg = __import__("configs.base", fromlist=["x"]).get_config().mesh
    mcfg.update(dict(data=2, expert=4))
    mesh = sharding.make_mesh(mcfg)
    _, model3 = hf_import.load_hf(str(tmp_path), mesh=mesh, rules=mcfg.rules)
    wg = model3.layers[1].mlp.wg[...]
    assert {s.data.shape[0] for s in wg.addressable_shards} == {1}  # 4 experts / 4 devices
    np.testing.assert_array_equal(np.asarray(wg), np.asarray(model.layers[1].mlp.wg[...]))
    tokens = _tokens(v=64, t=12)
    (_, x1), (_, x2) = _ours(model, tokens), _ours(model2, tokens)
    np.testing.assert_array_equal(np.asarray(x1["mtp_logits"]), np.asarray(x2["mtp_logits"]))


def test_fp8_block_dequant(tmp_path):
    rng = np.random.RandomState(0)
    w = rng.randn(200, 300).astype(np.float32) * np.linspace(0.1, 3, 300)[None]
    # per-128x128-block scales, as DeepSeek's FP8 checkpoints: w_fp8 = w / scale
    nb = (-(-200 // 128), -(-300 // 128))
    scale = np.zeros(nb, np.float32)
    for i in range(nb[0]):
        for j in range(nb[1]):
            scale[i, j] = np.abs(w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]).max() / 448.0
    s_full = np.repeat(np.repeat(scale, 128, 0), 128, 1)[:200, :300]
    w8 = torch.tensor(w / s_full).to(torch.float8_e4m3fn)
    deq = hf_import.dequant_fp8(w8.float().numpy(), scale)
    expected = w8.float().numpy() * s_full
    np.testing.assert_array_equal(deq, expected)
    assert np.abs(deq - w).max() <= 0.07 * np.abs(w).max()  # e4m3: 3 mantissa bits

    # through load_hf: replace one weight of a saved checkpoint by its FP8 form + scale_inv
    from safetensors.torch import load_file, save_file

    hf = _hf_model("groups_noqlora")
    hf.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    orig = tensors[name].numpy()  # [H*(dn+dv), r] = [56, 16]
    sc = np.array([[np.abs(orig).max() / 448.0]], np.float32)
    tensors[name] = torch.tensor(orig / sc[0, 0]).to(torch.float8_e4m3fn)
    tensors[name + "_scale_inv"] = torch.tensor(sc)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    _, model = hf_import.load_hf(str(tmp_path))
    got = np.asarray(model.layers[1].self_attn.kv_b_proj[...]).reshape(16, -1).T
    np.testing.assert_allclose(got, tensors[name].float().numpy() * sc[0, 0], rtol=1e-6)


def test_scanned_model_imports_and_exports_per_layer_names(tmp_path):
    """model.scan_layers stacks the MoE layers ([layers, ...]); HF files stay per layer."""
    hf = _hf_model("qlora_yarn")
    hf.save_pretrained(tmp_path / "hf")
    cfg, model = hf_import.load_hf(str(tmp_path / "hf"), scan_layers=True)
    assert model.moe_stack is not None and len(model.layers) == 1  # 1 dense layer, 2 stacked
    assert model.moe_stack.mlp.wg[...].shape[:2] == (2, 8)  # [layers, experts, ...]
    tokens = _tokens()
    ref = _theirs(hf, tokens)
    np.testing.assert_allclose(_ours(model, tokens)[0], ref, atol=1e-4, rtol=0)
    hf_export.save_hf(cfg, model, str(tmp_path / "ours"))
    hf2 = transformers.DeepseekV3ForCausalLM.from_pretrained(
        str(tmp_path / "ours"), attn_implementation="eager").eval()
    np.testing.assert_allclose(_theirs(hf2, tokens), ref, atol=1e-4, rtol=0)


def test_transformers_default_mtp_setting_imports_with_fresh_mtp(tmp_path, caplog):
    """transformers' default config says num_nextn_predict_layers=1 but saves no MTP tensors:
    the import starts that module fresh (logged) instead of stopping; the trunk is exact."""
    torch.manual_seed(0)
    base = {k: v for k, v in BASE.items() if k != "num_nextn_predict_layers"}
    cfg = transformers.DeepseekV3Config(**base, **CASES["groups_noqlora"])
    assert cfg.num_nextn_predict_layers == 1
    hf = transformers.DeepseekV3ForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    caplog.set_level("INFO")
    ours_cfg, model = hf_import.load_hf(str(tmp_path), vocab_size=100)
    assert ours_cfg.num_mtp_layers == 1 and len(model.mtp) == 1
    assert "MTP module 0: not in" in caplog.text and "starts fresh" in caplog.text
    assert "grow by 4 rows (ids 96..99)" in caplog.text
    tokens = _tokens()
    ours, aux = _ours(model, tokens)
    np.testing.assert_allclose(ours[..., :96], _theirs(hf, tokens), atol=1e-4, rtol=0)
    assert aux["mtp_logits"].shape == (1, 2, 24, 100)


def test_checkpoint_of_another_shape_is_an_error_naming_the_tensor(tmp_path):
    hf = _hf_model("groups_noqlora")
    hf.save_pretrained(tmp_path)
    cfg = hf_import.config_from_hf(json.load(open(tmp_path / "config.json")))
    cfg.moe_intermediate_size = 24  # not the checkpoint's 16
    cfg.dtype = "float32"
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"checkpoint's model\.layers\.1\.mlp\.\S+ has shape .*needs"):
        hf_import.import_into(model, str(tmp_path))


def test_remote_shard_reads_byte_ranges_like_the_local_reader(tmp_path):
    """A gs:// (here fsspec's memory://) shard is read by byte ranges of the rows a block covers;
    the blocks equal the local reader's (safetensors' numpy framework; float8 by a view)."""
    import fsspec
    from safetensors.torch import save_file

    tensors = {"f32": torch.randn(40, 24), "bf16": torch.randn(8, 6, 10).to(torch.bfloat16),
               "f8": torch.randn(30, 20).to(torch.float8_e4m3fn), "vec": torch.randn(7)}
    save_file(tensors, tmp_path / "s.safetensors")
    fsspec.filesystem("memory").pipe("/coder_test/s.safetensors", (tmp_path / "s.safetensors").read_bytes())
    local = hf_import._Shard(str(tmp_path / "s.safetensors"))
    remote = hf_import._Shard("memory://coder_test/s.safetensors")
    assert remote.remote and not local.remote
    for name, t in tensors.items():
        ranges = [(1, n - 1) if n > 2 else (0, n) for n in t.shape]
        a, b = local.read(name, ranges), remote.read(name, ranges)
        expected = t.float().numpy()[tuple(slice(x, y) for x, y in ranges)]
        np.testing.assert_array_equal(a.astype(np.float32), expected, err_msg=name)
        np.testing.assert_array_equal(b.astype(np.float32), expected, err_msg=name)


def _pack_int4(w: np.ndarray, group: int):
    """compressed-tensors' symmetric INT4 pack-quantized form of w `[out, in]`: (packed int32
    `[out, in / 8]`, bf16 scales `[out, in / group]`, the values it dequantizes to)."""
    import ml_dtypes

    out, cols = w.shape
    g = w.reshape(out, cols // group, group)
    scale = (np.abs(g).max(-1) / 7.0).astype(ml_dtypes.bfloat16)
    s = scale.astype(np.float32)
    q = np.clip(np.round(g / np.where(s == 0, 1, s)[..., None]), -8, 7).astype(np.int64).reshape(out, cols)
    u = (q + 8).reshape(out, cols // 8, 8)
    words = (u << (4 * np.arange(8))).sum(-1).astype(np.uint32).view(np.int32)
    return words, scale, (q.reshape(out, cols // group, group) * s[..., None]).reshape(out, cols).astype(np.float32)


def test_kimi_k25_wrapper_with_int4_experts_imports_its_text_model(tmp_path, caplog, export_cfg):
    """A checkpoint in Kimi K2.5's format, written here from a coder model: the multimodal wrapper
    (model_type kimi_k25, the text config under text_config, tensors under language_model.), the
    routed experts INT4 pack-quantized (compressed-tensors, group-wise bf16 scales, the scales in
    another shard) and a vision tower. The import reads the text model: every non-expert tensor
    bit-exact, every expert weight exactly its dequantized INT4 value (within the quantization
    step of the original); the vision tensors are skipped and the log says so."""
    import logging
    import re

    from safetensors.numpy import load_file, save_file

    cfg = export_cfg()
    model = Transformer(cfg, rngs=nnx.Rngs(5))
    plain = tmp_path / "plain"
    hf_export.save_hf(cfg, model, str(plain))
    index = json.load(open(plain / "model.safetensors.index.json"))["weight_map"]
    tensors = {}
    for fn in set(index.values()):
        tensors.update(load_file(str(plain / fn)))
    group, weights, scales, expected = 8, {}, {}, {}
    for name, w in tensors.items():
        if re.search(r"mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$", name):
            packed, scale, deq = _pack_int4(w.astype(np.float32), group)
            base = "language_model." + name
            weights[base + "_packed"] = packed
            weights[base + "_shape"] = np.array(w.shape, np.int64)
            scales[base + "_scale"] = scale
            expected[name] = deq
        else:
            weights["language_model." + name] = w
    weights["vision_tower.encoder.blocks.0.wqkv.weight"] = np.ones((8, 8), np.float32)
    weights["mm_projector.proj.0.weight"] = np.ones((4, 8), np.float32)
    k25 = tmp_path / "k25"
    k25.mkdir()
    save_file(weights, str(k25 / "model-00001-of-00002.safetensors"))
    save_file(scales, str(k25 / "model-00002-of-00002.safetensors"))
    weight_map = {**{n: "model-00001-of-00002.safetensors" for n in weights},
                  **{n: "model-00002-of-00002.safetensors" for n in scales}}
    json.dump({"metadata": {}, "weight_map": weight_map}, open(k25 / "model.safetensors.index.json", "w"))
    quant = {"quant_method": "compressed-tensors", "format": "pack-quantized",
             "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                 "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group}}},
             "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:vision_tower.*"]}
    text = json.load(open(plain / "config.json"))
    json.dump({"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
               "text_config": text, "vision_config": {"model_type": "moonvit"}, "quantization_config": quant},
              open(k25 / "config.json", "w"))

    with caplog.at_level(logging.INFO):
        cfg2, model2 = hf_import.load_hf(str(k25))
    log = caplog.text
    assert "kimi_k25 wrapper" in log and "2 tensors of its other towers" in log and "INT4" in log, log
    assert cfg2.n_routed_experts == 4 and cfg2.num_hidden_layers == 2
    got = {n: np.asarray(w) for n, w in hf_export._export_tensors(cfg2, nnx.to_flat_state(nnx.state(model2)))}
    assert got.keys() == tensors.keys()
    for name, w in tensors.items():
        if name in expected:
            np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
            step = np.abs(w).max() / 7.0
            assert np.abs(got[name] - w).max() <= 0.51 * step + 1e-6, name
        else:
            np.testing.assert_array_equal(got[name], w, err_msg=name)

    quant["config_groups"]["group_0"]["weights"]["symmetric"] = False
    json.dump({"model_type": "kimi_k25", "text_config": text, "quantization_config": quant},
              open(k25 / "config.json", "w"))
    with pytest.raises(ValueError, match="symmetric INT4 pack-quantized"):
        hf_import.load_hf(str(k25))
