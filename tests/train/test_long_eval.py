"""The long-context eval (coder/train/long_eval.py): position windows, the far-retrieval rows built
from a tiny repository, and the loss by position bucket of a tiny model checked against its
per-token losses."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from coder.model import Transformer
from coder.train import long_eval
from coder.train.losses import lm_loss
from configs import base
from tests.fakes import CharTokenizer

REPO = {
    "util.py": "def one():\n    return 1\n\n\ndef two():\n    return one() + one()\n",
    "core.py": ("import util\n\n\ndef scale(x):\n    \"\"\"x times two.\"\"\"\n    y = util.two() * x\n"
                "    return y + util.one()\n"),
    "big.py": "".join(f"def f{i}(a):\n    return a * {i} + {i * 7}\n\n\n" for i in range(40)),
}


def test_position_rows_are_round_robin_windows():
    docs = [np.arange(10), np.arange(100, 125), np.arange(200, 203)]
    rows = long_eval.position_rows(docs, 4, max_rows=5)
    np.testing.assert_array_equal(rows[:, 0], [0, 100, 4, 104, 108])  # doc 3 is shorter than a row
    assert rows.shape == (5, 4) and rows.dtype == np.int32


def test_retrieval_rows_differ_only_in_the_far_part():
    candidates = long_eval.retrieval_candidates(REPO, ["util.py", "core.py", "big.py"])
    # a callee above it in its own file counts: two() calls one()
    assert [(c[0], c[1].splitlines()[0], [src.split("(")[0] for _, src in c[3]]) for c in candidates
            if c[0] == "util.py"] == [("util.py", "def two():", ["def one"])]
    (cand,) = [c for c in candidates if c[0] == "core.py"]
    path, header, body, callees = cand
    assert header.startswith("def scale(x):") and '"""x times two."""' in header
    assert body == "    y = util.two() * x\n    return y + util.one()\n"
    assert [p for p, _ in callees] == ["util.py", "util.py"]
    tok = CharTokenizer(60)
    with_far, without, mask = long_eval.retrieval_rows(REPO, tok, 512, max_examples=4)
    assert with_far.shape == without.shape == mask.shape and len(with_far) >= 1
    for w, wo, m in zip(with_far, without, mask):
        n_body = int(m.sum())
        assert m[-n_body:].all() and not m[:-n_body].any()  # the body ends the row
        diff = np.flatnonzero(w != wo)
        assert diff.max() < 512 // 4  # only the first quarter (the far definitions) differs
    body_ids = tok.encode(body)
    row = next(r for r, m in zip(with_far, mask)
               if int(m.sum()) == len(body_ids) and (r[-len(body_ids):] == body_ids).all())
    far = tok.encode("# file: util.py\ndef one():\n    return 1\n"
                     "# file: util.py\ndef two():\n    return one() + one()\n")
    assert list(row[1 : 1 + len(far)]) == far  # the callees' definitions open the row


def tiny_model(vocab):
    m = base.get_config().model
    m.update(dict(vocab_size=vocab, hidden_size=16, intermediate_size=24, moe_intermediate_size=8,
                  num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2, kv_lora_rank=8,
                  qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4, n_routed_experts=4,
                  num_experts_per_tok=2, n_group=1, topk_group=1, num_mtp_layers=0, dtype="float32",
                  max_position_embeddings=64))
    m.rope_scaling.original_max_position_embeddings = 64
    return Transformer(m, rngs=nnx.Rngs(0))


def test_bucket_losses_are_the_per_token_losses_by_position():
    model = tiny_model(64)
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state, batch):
        logits, _ = nnx.merge(graphdef, state)(batch["tokens"], batch["positions"], batch["segment_ids"])
        return logits

    def score(batch):
        _, m = lm_loss(forward(state, batch), {}, batch, mtp_loss_weight=0.0, z_loss_weight=0.0)
        return float(m["ce"] * m["weight"]), float(m["weight"])

    rng = np.random.default_rng(0)
    docs = [rng.integers(3, 64, 200).astype(np.int32) for _ in range(2)]
    rows = {"windows": long_eval.position_rows(docs, 64, max_rows=5),
            "with": np.zeros((0, 64), np.int32), "without": np.zeros((0, 64), np.int32),
            "body_mask": np.zeros((0, 64), np.float32)}
    out = long_eval.long_context_eval(rows, score, buckets=4, rows=2)  # 5 rows: the last batch padded
    assert out["long/windows"] == 5 and "long/retrieval_gain" not in out
    # per-token next-token losses of the same windows, by the position of the target
    w = rows["windows"]
    logits = forward(state, {"tokens": w, "positions": np.tile(np.arange(64), (5, 1)),
                             "segment_ids": np.ones_like(w)})
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), w[:, 1:, None], -1)[..., 0]
    nll = np.asarray(nll)  # [5, 63]: the target at index t + 1
    for a, b in ((0, 16), (16, 32), (32, 48), (48, 64)):
        expected = nll[:, max(a, 1) - 1 : b - 1].mean()
        assert out[f"long/loss_{a}_{b}"] == pytest.approx(expected, rel=1e-5), (a, b)
    assert out["long/loss_far"] == out["long/loss_48_64"]
