"""Starting a stage from a Hugging Face checkpoint (`init_from` = a DeepseekV3ForCausalLM directory
with its own tokenizer), and going back: coder.model.hf_import, coder.data.pretrained_tokenizer,
coder.stages.inherit_model_config, coder.train.state.load_into, stage_tokenizer.

The checkpoint is transformers' own save of a small DeepseekV3ForCausalLM with transformers'
*default* MTP setting (num_nextn_predict_layers=1, no MTP tensors saved), beside a small BPE
tokenizer trained here with `tokenizers` (tokenizer.json) or with tiktoken (tiktoken.model).
Neither tokenizer has the chat template's tokens, so all 11 are added and the vocabulary grows.
"""
import base64
import glob
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from coder import stages  # noqa: E402
from coder.data import chat_template  # noqa: E402
from coder.data import tokenizer as tk  # noqa: E402
from coder.model import hf_export  # noqa: E402
from coder.model import sharding  # noqa: E402
from coder.train import checkpoint as ckpt_lib  # noqa: E402
from coder.train import state as state_lib  # noqa: E402
from coder.train.flat import state_to_flat  # noqa: E402
from tests import xla_flags  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PYTHON = os.path.abspath(sys.executable)
N_CHAT = len(chat_template.SPECIAL_TOKENS)
# GPT-2's pre-tokenizer for the test's tiktoken file (Kimi K2's is the default of the key)
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
CODE = "def f(x):\n    if x:\n\t\treturn 12345  # caf\u00e9 \U0001F600\n\n\n    return None   \r\n"
MESSAGES = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Fix the bug in a.py"},
    {"role": "assistant", "content": 'Reading it.<tool_call>{"name": "read_file", "arguments": {"path": "a.py"}}</tool_call>'},
    {"role": "tool", "content": "<tool_result>def f():\n    return 1\n</tool_result>"},
    {"role": "assistant", "content": "It returns 1: fixed.\n"},
]


def _texts(limit=60_000):
    files = sorted(glob.glob(os.path.join(os.path.dirname(json.__file__), "*.py")))
    return "".join(open(f).read() for f in files)[:limit]


def _save_bpe(directory) -> int:
    """A byte-level BPE trained with `tokenizers` (tokenizer.json + tokenizer_config.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = _texts()
    tok.train_from_iterator([text[i:i + 2000] for i in range(0, len(text), 2000)], trainer)
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>"}, f)
    return tok.get_vocab_size(with_added_tokens=True)


def _save_tiktoken(directory) -> int:
    """A tiktoken BPE file (base64 token, rank per line) trained with tiktoken's own trainer, with
    Kimi-style special tokens after the ranks in tokenizer_config.json."""
    from tiktoken._educational import bpe_train

    ranks = bpe_train(_texts(12_000), 320, GPT2_PATTERN, visualise=None)
    with open(os.path.join(directory, "tiktoken.model"), "w") as f:
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(token).decode()} {rank}\n")
    n = len(ranks)
    specials = {str(n): {"content": "[BOS]", "special": True}, str(n + 1): {"content": "[EOS]", "special": True}}
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "[BOS]", "eos_token": "[EOS]", "added_tokens_decoder": specials}, f)
    return n + 2


def _save_hf_model(directory, vocab: int, bos: int, eos: int, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.DeepseekV3Config(  # num_nextn_predict_layers: transformers' default (1)
        vocab_size=vocab, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, kv_lora_rank=16, q_lora_rank=None,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, max_position_embeddings=512, rms_norm_eps=1e-6,
        bos_token_id=bos, eos_token_id=eos)
    assert cfg.num_nextn_predict_layers == 1
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():  # larger-than-default weights so differences would show
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.15 * torch.randn_like(p))
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.copy_(0.1 * torch.randn(cfg.n_routed_experts))
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module", params=["hf_tokenizers", "tiktoken"])
def hf_dir(request, tmp_path_factory):
    """(directory, transformers model, base vocabulary, kind)."""
    d = tmp_path_factory.mktemp(request.param)
    if request.param == "hf_tokenizers":
        vocab = _save_bpe(d)
        bos, eos = 0, 1
    else:
        vocab = _save_tiktoken(d)
        bos, eos = vocab - 2, vocab - 1
    model = _save_hf_model(d, vocab, bos, eos)
    return str(d), model, vocab, request.param


def _config(hf_path, kind, workdir=""):
    """The config a stage runs with: the quickstart's model keys (which differ from the
    checkpoint's and lose), float32, the test's tiktoken pattern."""
    from configs import quickstart

    c = quickstart.get_config()
    c.stages, c.stage = (), "sft"
    c.init_from = hf_path
    c.workdir = workdir
    c.model.dtype = "float32"
    if kind == "tiktoken":
        c.data.tiktoken_pattern = GPT2_PATTERN
    return c


def _logits_theirs(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def _logits_ours(model, tokens):
    b, t = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    logits, aux = model(jnp.asarray(tokens), pos, jnp.ones((b, t), jnp.int32))
    return np.asarray(logits), aux


@pytest.mark.slow
def test_stage_model_from_hf_equals_transformers(hf_dir, caplog, tmp_path):
    """The stage's own path (inherit_model_config -> stage_config -> stage_tokenizer ->
    build_model -> load_into): before any step, transformers' logits on the checkpoint's rows;
    the chat tokens added after them; the MTP module fresh. Then, for each tokenizer kind, the
    tokenizer's checkpoint record (to_record -> JSON -> from_record) and export with save_hf:
    transformers loads the weights (same logits as ours) and the tokenizer (same ids, same chat
    rendering). The sft stage run through main.py is test_sft_from_hf_dir_with_main_then_export."""
    path, hf_model, vocab, kind = hf_dir
    caplog.set_level("INFO")
    config = _config(path, kind)
    c = stages.stage_config("sft", stages.inherit_model_config(config, path))
    assert (c.model.hidden_size, c.model.num_hidden_layers, c.model.n_routed_experts) == (32, 2, 4)
    assert c.model.vocab_size == vocab + N_CHAT  # grown by the 11 template tokens
    assert c.model.num_mtp_layers == 1  # the stage's own
    assert "model.hidden_size from" in caplog.text  # the config's 128 lost, reported

    tok = ckpt_lib.stage_tokenizer(c, path, "")
    assert tok.kind == kind
    assert tok.vocab_size == vocab + N_CHAT
    assert sorted(tok.added_tokens.values()) == list(range(vocab, vocab + N_CHAT))
    assert tok.decode(tok.encode(CODE)) == CODE
    ids, mask = tok.render_conversation(MESSAGES)
    assert tok.decode(ids).startswith("<|system|>You are a coding agent.<|end|><|user|>")
    assert (ids == tok.special_id("<tool_call>")).sum() == 1 and mask.sum() > 0

    model = state_lib.build_model(c, seed=1)
    before = np.asarray(model.mtp[0].eh_proj[...])
    report = state_lib.load_into(model, path)
    assert report["fresh_mtp"] == [0] and report["vocab"] == (vocab, vocab + N_CHAT)
    assert "MTP module 0: not in" in caplog.text and "starts fresh" in caplog.text
    assert f"grow by {N_CHAT} rows" in caplog.text
    np.testing.assert_array_equal(np.asarray(model.mtp[0].eh_proj[...]), before)  # kept its init

    tokens = np.asarray(tok.encode(CODE * 2)[:40], np.int32)[None].repeat(2, 0)
    tokens[1] = np.random.RandomState(0).randint(0, vocab, size=tokens.shape[1])
    ref = _logits_theirs(hf_model, tokens)
    ours, _ = _logits_ours(model, tokens)
    assert ours.shape[-1] == vocab + N_CHAT
    np.testing.assert_allclose(ours[..., :vocab], ref, atol=1e-4, rtol=0)
    assert np.abs(ref).max() > 1.0
    # new rows: the mean of the checkpoint's (embedding and output head)
    emb = np.asarray(model.embed[...])
    np.testing.assert_allclose(emb[vocab:], np.broadcast_to(emb[:vocab].mean(0), (N_CHAT, emb.shape[1])), atol=1e-6)
    head = np.asarray(model.lm_head[...])
    np.testing.assert_allclose(head[:, vocab:], np.broadcast_to(head[:, :vocab].mean(1, keepdims=True), (head.shape[0], N_CHAT)), atol=1e-6)
    # a chat token's input works (finite logits)
    chat_ids = np.asarray([[tok.special_id("assistant"), tok.end_id]], np.int32)
    assert np.isfinite(_logits_ours(model, chat_ids)[0]).all()

    # the checkpoint's record of this tokenizer kind (what Trainer.save writes) and back
    record = json.loads(json.dumps(tk.to_record(tok)))
    assert record["kind"] == kind
    tok = tk.from_record(record)
    assert tok.vocab_size == vocab + N_CHAT and tk.fingerprint(tok) == record["sha256"]
    _check_export(c, model, tok, str(tmp_path / "export"), vocab)


def _check_export(c, model, tok, out, vocab):
    """save_hf with the tokenizer: transformers loads the weights (same logits as ours) and the
    tokenizer (same ids, same chat rendering)."""
    hf_export.save_hf(c.model, model, out, tokenizer=tok)
    names = set(json.load(open(os.path.join(out, "model.safetensors.index.json")))["weight_map"])
    assert "model.layers.2.eh_proj.weight" in names  # the MTP module goes back too
    hf2 = transformers.DeepseekV3ForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    tokens = np.asarray(tok.render_conversation(MESSAGES)[0][:48], np.int32)[None]
    np.testing.assert_allclose(_logits_theirs(hf2, tokens), _logits_ours(model, tokens)[0], atol=1e-4, rtol=0)
    auto = transformers.AutoTokenizer.from_pretrained(out)
    assert len(auto) == vocab + N_CHAT
    for text in (CODE, MESSAGES[2]["content"]):
        assert auto.encode(text, add_special_tokens=False) == tok.encode(text)
    rendered = auto.apply_chat_template(MESSAGES, tokenize=True, return_dict=False)
    assert list(rendered) == tok.render_conversation(MESSAGES)[0].tolist()
    assert auto.decode(tok.encode(CODE)) == CODE


@pytest.mark.slow
def test_sharded_import_equals_unsharded(hf_dir):
    """On a mesh (8 devices: experts over 4, the rest over 2) each process reads only its blocks;
    the same values as one device."""
    path, _, vocab, kind = hf_dir
    if kind != "hf_tokenizers":
        pytest.skip("the layout does not depend on the tokenizer")
    c = stages.inherit_model_config(_config(path, kind), path)
    c.mesh.update(dict(data=2, expert=4))
    mesh = sharding.make_mesh(c.mesh)
    sharded = state_lib.build_model(c, mesh)
    state_lib.load_into(sharded, path)
    wg = sharded.layers[1].mlp.wg[...]
    assert {s.data.shape[0] for s in wg.addressable_shards} == {1}  # 4 experts / 4 devices
    c1 = stages.inherit_model_config(_config(path, kind), path)
    one = state_lib.build_model(c1, sharding.make_mesh(c1.mesh, jax.devices()[:1]))
    state_lib.load_into(one, path)
    a = state_to_flat(nnx.state(sharded))
    b = state_to_flat(nnx.state(one))
    for name in a:
        if not name.startswith("mtp."):  # fresh: seeded init differs between meshes
            np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]), err_msg=name)


def _run_main(workdir, *args):
    env = dict(os.environ, XLA_FLAGS=xla_flags.one_device(os.environ.get("XLA_FLAGS", "")))  # one CPU device
    env.update(PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    return subprocess.run([PYTHON, "main.py", "--config=configs/quickstart.py", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_sft_from_hf_dir_with_main_then_export(hf_dir, tmp_path):
    """`main.py --config.init_from=DIR --config.stage=sft` a few steps: the log reports the fresh
    MTP module, the grown vocabulary and the model keys taken from config.json; the checkpoint
    holds the pretrained tokenizer. Then export: transformers loads the weights (same logits as
    ours) and the tokenizer (same ids, same chat rendering).

    One tokenizer kind: the stage run does not depend on it (the tokenizer is loaded, written into
    the checkpoint and exported by the functions test_stage_model_from_hf_equals_transformers runs
    for both kinds: stage_tokenizer, to_record / from_record, save_hf)."""
    path, _, vocab, kind = hf_dir
    if kind != "hf_tokenizers":
        pytest.skip("the stage run does not depend on the tokenizer kind (both kinds' tokenizer "
                    "record and export: test_stage_model_from_hf_equals_transformers)")
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"messages": MESSAGES}) + "\n" for _ in range(8)))
    workdir = tmp_path / "run"
    args = [f"--config.workdir={workdir}", f"--config.init_from={path}", "--config.stage=sft",
            "--config.stages=()", f"--config.sft.data={data}", "--config.sft.steps=3",
            "--config.sft.seq_len=256", "--config.sft.batch_size=2", "--config.train.log_every=1",
            "--config.train.warmup_steps=1", "--config.model.dtype=float32"]
    p = _run_main(workdir, *args)
    assert p.returncode == 0, p.stderr[-4000:]
    log = p.stderr
    assert "MTP module 0: not in" in log and "starts fresh" in log, log[-3000:]
    assert f"grow by {N_CHAT} rows" in log, log[-3000:]
    assert "model.hidden_size from" in log, log[-3000:]
    records = [json.loads(line) for line in (workdir / "sft" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps[-1] == 3 and all(np.isfinite(r["loss"]) for r in records if "loss" in r)

    ckpt = str(workdir / "sft" / "checkpoints")
    record = ckpt_lib.read_item(ckpt, "tokenizer")
    assert record["kind"] == kind
    tok = tk.from_record(record)
    assert tok.vocab_size == vocab + N_CHAT

    # the next stage's config comes from the coder checkpoint alone
    c = stages.inherit_model_config(_config("", kind), ckpt)
    assert (c.model.hidden_size, c.model.vocab_size) == (32, vocab + N_CHAT)
    assert tk.fingerprint(ckpt_lib.stage_tokenizer(c, ckpt, "")) == record["sha256"]
    model = state_lib.load_model(c, ckpt)

    _check_export(c, model, tok, str(tmp_path / "export"), vocab)


@pytest.mark.slow
def test_import_without_torch(hf_dir, tmp_path):
    """The import path never imports torch: a subprocess where `import torch` raises imports the
    checkpoint (FP8-quantized weight included) and gets transformers' logits."""
    path, hf_model, vocab, kind = hf_dir
    if kind != "hf_tokenizers":
        pytest.skip("one tokenizer kind is enough")
    import shutil

    from safetensors.torch import load_file, save_file

    d = tmp_path / "fp8"
    shutil.copytree(path, d)
    tensors = load_file(d / "model.safetensors")
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    orig = tensors[name].numpy()
    scale = np.float32(np.abs(orig).max() / 448.0)
    tensors[name] = torch.tensor(orig / scale).to(torch.float8_e4m3fn)
    tensors[name + "_scale_inv"] = torch.tensor([[scale]])
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    tokens = np.random.RandomState(3).randint(0, vocab, size=(1, 16)).astype(np.int32)
    with torch.no_grad():  # the reference: transformers with the dequantized weight
        deq = tensors[name].float() * scale
        layer = hf_model.model.layers[1].self_attn.kv_b_proj
        saved = layer.weight.clone()
        layer.weight.copy_(deq)
        ref = _logits_theirs(hf_model, tokens)
        layer.weight.copy_(saved)
    np.save(tmp_path / "tokens.npy", tokens)
    np.save(tmp_path / "ref.npy", ref)
    script = f"""
import sys
sys.modules["torch"] = None  # `import torch` raises ImportError from here on
import numpy as np, jax.numpy as jnp
from coder.model import hf_import
cfg, model = hf_import.load_hf({str(d)!r}, num_mtp_layers=1, vocab_size={vocab + N_CHAT})
tokens = np.load({str(tmp_path / 'tokens.npy')!r})
pos = jnp.arange(tokens.shape[1])[None]
logits, _ = model(jnp.asarray(tokens), pos, jnp.ones_like(pos))
ref = np.load({str(tmp_path / 'ref.npy')!r})
np.testing.assert_allclose(np.asarray(logits)[..., :ref.shape[-1]], ref, atol=1e-4, rtol=0)
tok = hf_import.tokenizer_of({str(d)!r}, __import__("configs.base", fromlist=["x"]).get_config().data)
assert tok.decode(tok.encode("x = 1")) == "x = 1"
assert "torch" not in [m for m in sys.modules if sys.modules[m] is not None and m.split(".")[0] == "torch"]
print("ok")
"""
    env = dict(os.environ, XLA_FLAGS=xla_flags.one_device(os.environ.get("XLA_FLAGS", "")))
    env.update(PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    p = subprocess.run([PYTHON, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-3000:]


def test_missing_trunk_tensor_is_an_error_naming_it(hf_dir, tmp_path):
    path, _, _, kind = hf_dir
    if kind != "hf_tokenizers":
        pytest.skip("one tokenizer kind is enough")
    import shutil

    from safetensors.numpy import load_file, save_file

    d = tmp_path / "broken"
    shutil.copytree(path, d)
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    c = stages.inherit_model_config(_config(str(d), kind), str(d))
    model = state_lib.build_model(c)
    with pytest.raises(ValueError, match=r"lacks 1 tensors .*model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight"):
        state_lib.load_into(model, str(d))
