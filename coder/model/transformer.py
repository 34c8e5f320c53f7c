"""The DeepSeek-V3 / Kimi-K2 decoder with multi-token-prediction (MTP) modules.

    h_0 = Embed(tokens)                                                     [B,T,D]
    h_l = h' + FFN_l(RMSNorm(h')),  h' = h_{l-1} + MLA_l(RMSNorm(h_{l-1}))   l = 1..L
          FFN_l = dense SwiGLU for l <= first_k_dense_replace, else MoE
    logits = RMSNorm(h_L) W_head                                            [B,T,V] float32

MTP module k (DeepSeek-V3 section 2.2), k = 0..num_mtp_layers-1, depth d = k+1:
    h^d_t = Block_k(eh_proj([enorm(Embed(tokens[t+d])), hnorm(h^{d-1}_t)]))
    logits^d_t = shared_head.norm(h^d_t) W_head, predicting tokens[t+d+1]
with h^0 = h_L (the trunk's last hidden state, before the final norm); the embedding and output
head are shared with the trunk.

MoE statistics in `aux` cover the trunk's MoE layers (`router_load`, `expert_ids`,
`router_z_loss`, replayed through `routing=`; `router_ids`, each router's own top-k, which
differs from `expert_ids` only where `routing=` overrode it); the MTP modules' own go in
`mtp_router_load` / `mtp_expert_ids`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from coder.model import attention_kernels
from coder.model.attention import MLA, CacheIndex, init_layer_cache
from coder.model.layers import MLP, RMSNorm, dtype_of, param, weight
from coder.model.moe import MoE
from coder.model.sharding import constrain

REMAT_POLICIES = {
    "full": None,  # save nothing inside a block, recompute everything
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_qkv_proj": jax.checkpoint_policies.save_only_these_names("q_proj", "kv_proj"),
    # as "full", but the attention kernel's output and log-sum-exp are kept (TPU splash; a few
    # MB per layer and row at 32k), so the backward pass does not rerun the forward kernel
    "save_attention": jax.checkpoint_policies.save_only_these_names(attention_kernels.RESIDUALS),
}
HIDDEN = ("batch", "res_seq", None)  # the residual stream (coder.model.config.default_rules)


class Block(nnx.Module):
    """Pre-norm MLA + (dense | MoE) FFN block."""

    def __init__(self, cfg, layer_idx: int, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg)
        self.self_attn = MLA(cfg, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg)
        self.is_moe = layer_idx >= cfg.first_k_dense_replace
        self.mlp = MoE(cfg, rngs) if self.is_moe else MLP(cfg, cfg.intermediate_size, rngs)

    def __call__(self, x, positions, segment_ids, cache=None, expert_ids=None, prefix_segment=None,
                 cache_at: CacheIndex = CacheIndex()):
        """x `[B,T,D]` -> (x, layer cache, MoE stats or None); prefix_segment, cache_at as MLA's."""
        a, cache = self.self_attn(self.input_layernorm(x), positions, segment_ids, cache, prefix_segment,
                                  cache_at)
        x = constrain(x + a.astype(x.dtype), HIDDEN)
        h = self.post_attention_layernorm(x)
        stats = None
        if self.is_moe:
            f, stats = self.mlp(h, segment_ids > 0, expert_ids)
        else:
            f = self.mlp(h)
        return constrain(x + f.astype(x.dtype), HIDDEN), cache, stats


class MTPModule(nnx.Module):
    def __init__(self, cfg, k: int, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.enorm = RMSNorm(d, cfg)
        self.hnorm = RMSNorm(d, cfg)
        self.eh_proj = param(rngs, (2 * d, d), (None, "embed"), cfg)
        self.block = Block(cfg, cfg.num_hidden_layers + k, rngs)
        self.shared_head_norm = RMSNorm(d, cfg)


@jax.custom_vjp
def head_logits(h, w):
    """The output head: h `[B,T,D]` x w `[D,V]` (both the model's dtype) -> logits `[B,T,V]` in
    float32 (f32 accumulation, f32 logits for the loss).

    Its backward multiplies in the model's dtype with float32 accumulation: the logits'
    cotangent is cast to h's dtype first. JAX's own transpose of a dot with
    `preferred_element_type=float32` keeps the float32 cotangent and upcasts the bf16 operand,
    so both backward matmuls ran float32 x float32 (TF32 at best on a GPU; on the ~1B MoE's H100
    step, 4.4 TFLOP of them) and read the float32 cotangent twice. In float32 models this is the
    plain VJP."""
    return jnp.einsum("btd,dv->btv", h, w, preferred_element_type=jnp.float32)


def _head_fwd(h, w):
    return head_logits(h, w), (h, w)


def _head_bwd(res, g):
    h, w = res
    g = g.astype(h.dtype)
    dh = jnp.einsum("btv,dv->btd", g, w, preferred_element_type=jnp.float32).astype(h.dtype)
    dw = jnp.einsum("btd,btv->dv", h, g, preferred_element_type=jnp.float32).astype(w.dtype)
    return dh, dw


head_logits.defvjp(_head_fwd, _head_bwd)


class Transformer(nnx.Module):
    def __init__(self, cfg, rngs: nnx.Rngs):
        self.cfg = cfg
        v, d = cfg.vocab_size, cfg.hidden_size
        self.embed = param(rngs, (v, d), ("vocab", "embed"), cfg, float32_compute=True)  # the lookup
        blocks = [Block(cfg, i, rngs) for i in range(cfg.num_hidden_layers)]
        n_dense = min(cfg.first_k_dense_replace, cfg.num_hidden_layers)
        self.moe_stack = nnx.data(None)
        if cfg.scan_layers and cfg.num_hidden_layers - n_dense > 0:
            blocks, self.moe_stack = blocks[:n_dense], nnx.data(stack_blocks(blocks[n_dense:]))
        self.layers = nnx.List(blocks)
        self.norm = RMSNorm(d, cfg)
        self.lm_head = None if cfg.tie_word_embeddings else param(rngs, (d, v), ("embed", "vocab"), cfg)
        self.mtp = nnx.List([MTPModule(cfg, k, rngs) for k in range(cfg.num_mtp_layers)])
        self.dtype = dtype_of(cfg.dtype)
        if cfg.remat not in ("none", *REMAT_POLICIES):
            raise ValueError(f"model.remat={cfg.remat!r}: expected 'none' or one of {tuple(REMAT_POLICIES)}")
        self.remat = cfg.remat

    # ------------------------------------------------------------------ pieces
    def _embed(self, tokens):
        # the table whole along `embed` (vocabulary-parallel lookup): left split over the axes
        # that also split the tokens (FSDP), XLA:TPU gathered the looked-up rows across the
        # data-parallel replicas instead (a DCN transfer per micro-batch between TPU slices)
        table = weight(self.embed)
        return constrain(jnp.take(table, tokens, axis=0).astype(self.dtype), HIDDEN)

    def head_weight(self):
        """The output head's weight `[D,V]` in the model's dtype (the embedding's transpose when
        tied)."""
        return weight(self.embed, self.dtype).T if self.lm_head is None else weight(self.lm_head, self.dtype)

    def _head(self, h, logits: bool = True):
        """h `[B,T,D]` (already normed) -> logits `[B,T,V]` float32 (`head_logits`); with
        logits=False h itself in the model's dtype, for a loss that applies `head_weight` in
        chunks (coder.train.losses.chunked_cross_entropy_sum)."""
        if not logits:
            return h.astype(self.dtype)
        return constrain(head_logits(h.astype(self.dtype), self.head_weight()), ("batch", "seq", "vocab"))

    def _block(self, block, *args):
        if self.remat == "none":
            return block(*args)
        # jax.checkpoint over the block's state rather than nnx.remat: nnx.remat re-traces the
        # block's variables (RouterBias included) and refuses them under the trainer's scan.
        graphdef, state = nnx.split(block)
        run = jax.checkpoint(lambda s, *a: nnx.merge(graphdef, s)(*a), policy=REMAT_POLICIES[self.remat])
        return run(state, *args)

    def _scan(self, x, positions, segment_ids, routing, prefix_segment=None):
        """The stacked MoE layers as one lax.scan (remat per layer) -> (x, stats `[layers, ...]`)."""
        graphdef, state = nnx.split(self.moe_stack)

        def layer(x, xs):
            s, replay = xs
            x, _, stats = nnx.merge(graphdef, s)(x, positions, segment_ids, None, replay, prefix_segment)
            return x, stats

        if self.remat != "none":
            layer = jax.checkpoint(layer, policy=REMAT_POLICIES[self.remat])
        return jax.lax.scan(layer, x, (state, routing))

    def _scan_cached(self, x, positions, segment_ids, stack_cache, routing, rows):
        """The stacked MoE layers of a cached call as one lax.scan over (layer, its slice of the
        stacked cache) -> (x, stacked cache, stats `[layers, ...]`). The cache rides in the carry,
        so each layer scatters its tokens into the stack in place and reads its own slice: XLA
        compiles one layer body, not one per layer (61 unrolled layers took K2's 256k engine past
        45 minutes of compile), and holds the cache once."""
        graphdef, state = nnx.split(self.moe_stack)
        n = jax.tree.leaves(state)[0].shape[0]

        def layer(carry, xs):
            x, c = carry
            s, replay, i = xs
            x, c, stats = nnx.merge(graphdef, s)(x, positions, segment_ids, c, replay, None,
                                                 CacheIndex(rows=rows, layer=i))
            return (x, c), stats

        (x, stack_cache), stats = jax.lax.scan(layer, (x, stack_cache), (state, routing, jnp.arange(n)))
        return x, stack_cache, stats

    # ------------------------------------------------------------------ API
    def __call__(self, tokens, positions, segment_ids, cache=None, routing=None, *, mtp=None,
                 prefix_segment=None, cache_rows=None, logits: bool = True):
        """tokens/positions/segment_ids int32 `[B,T]` -> (logits `[B,T,V]` float32, aux).

        logits=False: the final normed hidden states `[B,T,D]` in place of the logits, and the
        MTP modules' as aux["mtp_hidden"] `[D,B,T,D]` in place of aux["mtp_logits"] (the head
        left to the loss: `head_weight`, coder.train.losses.chunked_cross_entropy_sum).

        cache: from `init_cache` (writes at `positions`, attends to slots <= position).
        cache_rows: `[B]` int32, the cache row (slot) of each batch row when `cache` holds more
        rows than the batch (an engine's pool: read and written in place; == the pool's slot
        count: padding); None: row b is cache row b.
        routing: `[moe_layers, B, T, top_k]` expert ids to replay (aux["expert_ids"] of a call).
        mtp: run the MTP modules (default: yes without a cache, no with one; decoding calls
        `mtp_module` itself).
        prefix_segment: `[B,T]` int32, shared-prefix rows (coder.model.attention_kernels
        .attention_mask): each token also attends to the segment it names (0 = none). Full
        forward without MTP only: MTP's shifted targets would cross from a prompt into a
        continuation it does not precede.
        """
        run_mtp = (cache is None) if mtp is None else mtp
        if prefix_segment is not None and (cache is not None or (run_mtp and len(self.mtp))):
            raise ValueError("prefix_segment (shared-prefix rows) needs a full forward with mtp=False: "
                             "no cache, no MTP modules")
        x = self._embed(tokens)
        loads, ids, own, zs, drops, new_layers = [], [], [], [], [], []  # MoE stats: [layers, ...]

        def record(stats, stacked=False):
            expand = (lambda a: a) if stacked else (lambda a: a[None])
            loads.append(expand(stats["load"]))
            ids.append(expand(stats["expert_ids"]))
            own.append(expand(stats["router_ids"]))
            zs.append(expand(stats["z"]))
            if "dropped" in stats:
                drops.append(expand(stats["dropped"]))

        m = 0
        for i, block in enumerate(self.layers):
            layer_cache = None if cache is None else cache["layers"][i]
            replay = None
            if routing is not None and block.is_moe:
                replay = routing[m]
            x, layer_cache, stats = self._block(block, x, positions, segment_ids, layer_cache, replay,
                                                prefix_segment, CacheIndex(rows=cache_rows))
            new_layers.append(layer_cache)
            if stats is not None:
                record(stats)
                m += 1
        stack_cache = None
        if self.moe_stack is not None:
            replay = None if routing is None else routing[m:]
            if cache is None:
                x, stats = self._scan(x, positions, segment_ids, replay, prefix_segment)
            else:
                x, stack_cache, stats = self._scan_cached(x, positions, segment_ids, cache["stack"], replay,
                                                          cache_rows)
            record(stats, stacked=True)
        b, t = tokens.shape
        cfg = self.cfg
        aux = dict(
            hidden=x,
            router_load=jnp.concatenate(loads) if loads else jnp.zeros((0, cfg.n_routed_experts)),
            expert_ids=jnp.concatenate(ids) if ids else jnp.zeros((0, b, t, cfg.num_experts_per_tok), jnp.int32),
            router_ids=jnp.concatenate(own) if own else jnp.zeros((0, b, t, cfg.num_experts_per_tok), jnp.int32),
            router_z_loss=jnp.mean(jnp.concatenate(zs)) if zs else jnp.zeros(()),
        )
        if drops:  # model.moe_capacity_factor > 0: mean fraction of pairs over capacity
            aux["router_dropped"] = jnp.mean(jnp.concatenate(drops))
        out = self._head(self.norm(x), logits)
        new_cache = None
        if cache is not None:
            new_cache = dict(cache, layers=new_layers)
            if stack_cache is not None:
                new_cache["stack"] = stack_cache
        if run_mtp and len(self.mtp):
            h, mtp_logits, mtp_loads, mtp_ids = x, [], [], []
            for k in range(len(self.mtp)):
                nxt = jnp.pad(tokens[:, k + 1:], ((0, 0), (0, k + 1)))  # tokens[t+k+1], 0 past the end
                h, lg, new_cache, stats = self._mtp(k, h, nxt, positions, segment_ids, new_cache, cache_rows,
                                                    logits)
                mtp_logits.append(lg)
                if stats is not None:
                    mtp_loads.append(stats["load"])
                    mtp_ids.append(stats["expert_ids"])
            aux["mtp_logits" if logits else "mtp_hidden"] = jnp.stack(mtp_logits)
            if mtp_loads:
                aux["mtp_router_load"] = jnp.stack(mtp_loads)
                aux["mtp_expert_ids"] = jnp.stack(mtp_ids)
        if cache is not None:
            aux["cache"] = new_cache
        return out, aux

    def _mtp(self, k, hidden, next_tokens, positions, segment_ids, cache, cache_rows=None, logits: bool = True):
        mod = self.mtp[k]
        e = mod.enorm(self._embed(next_tokens))
        h = mod.hnorm(hidden.astype(self.dtype))
        x = jnp.concatenate([e, h], axis=-1) @ weight(mod.eh_proj, self.dtype)
        layer_cache = None if cache is None else cache["mtp"][k]
        x, layer_cache, stats = self._block(mod.block, constrain(x, HIDDEN), positions, segment_ids,
                                            layer_cache, None, None, CacheIndex(rows=cache_rows))
        out = self._head(mod.shared_head_norm(x), logits)
        if cache is not None:
            mtp_caches = list(cache["mtp"])
            mtp_caches[k] = layer_cache
            cache = dict(cache, mtp=mtp_caches)
        return x, out, cache, stats

    def mtp_module(self, k, hidden, next_tokens, positions, segment_ids, cache=None, cache_rows=None):
        """Run MTP module k on the previous depth's hidden `[B,T,D]` and tokens[t+k+1] `[B,T]`.

        Returns (hidden_out `[B,T,D]`, logits `[B,T,V]` float32, cache) — cache is the whole
        model cache from `init_cache` with module k's entry updated (None if not given).
        """
        h, logits, cache, _ = self._mtp(k, hidden, next_tokens, positions, segment_ids, cache, cache_rows)
        return h, logits, cache


def stack_blocks(blocks: list) -> Block:
    """Blocks of one structure -> one Block whose every variable has a leading layer axis
    (logical axis "layers"). Built from the same per-layer initialisation as the unrolled
    model, so a scanned and an unrolled model from one seed hold the same numbers."""
    graphdef, first = nnx.split(blocks[0])
    states = [first] + [nnx.split(b)[1] for b in blocks[1:]]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
    for _, var in nnx.to_flat_state(stacked):
        axes = var.get_metadata().get("logical_axes")
        if axes is not None:
            var.set_metadata(logical_axes=("layers", *axes))
    return nnx.merge(graphdef, stacked)


def init_cache(model_cfg, batch: int, max_len: int, dtype=jnp.bfloat16) -> dict:
    """{"layers": [per unstacked trunk layer], "mtp": [per MTP module]}, each {latent `[B,S,r]`,
    rope `[B,S,dr]`} of zeros, indexed by absolute position (+ NSA's compressed k_cmp / v_cmp
    with attention_backend="nsa", see attention.init_layer_cache). With `model.scan_layers` the
    MoE layers' caches are one more entry, "stack": the same leaves with a layer axis after the
    slot axis, `[B, L_moe, S, ...]` (Transformer._scan_cached), so every leaf keeps its slot on
    axis 0."""
    n_dense = min(model_cfg.first_k_dense_replace, model_cfg.num_hidden_layers)
    stacked = model_cfg.scan_layers and model_cfg.num_hidden_layers > n_dense
    unstacked = n_dense if stacked else model_cfg.num_hidden_layers
    cache = dict(
        layers=[init_layer_cache(model_cfg, batch, max_len, dtype) for _ in range(unstacked)],
        mtp=[init_layer_cache(model_cfg, batch, max_len, dtype) for _ in range(model_cfg.num_mtp_layers)],
    )
    if stacked:
        one = jax.eval_shape(lambda: init_layer_cache(model_cfg, batch, max_len, dtype))
        n = model_cfg.num_hidden_layers - n_dense
        cache["stack"] = {k: jnp.zeros((batch, n, *v.shape[1:]), v.dtype) for k, v in one.items()}
    return cache


def count_params(model_cfg) -> dict:
    """Parameter counts from abstract shapes (nothing is allocated).

    total: trunk parameters incl. embedding and output head, *excluding* MTP modules (as
    DeepSeek-V3's published 671B); active: per-token activated parameters of the trunk (routed
    experts count num_experts_per_tok / n_routed_experts of their weights, embedding and head
    included); mtp: the MTP modules' own parameters (their embedding/head are shared);
    mtp_active: the part of those one token touches (routed experts at top-k / n_routed).
    """
    abstract = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
    total = mtp = routed = mtp_routed = 0
    for path, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        n = 1
        for s in v.get_value().shape:
            n *= s
        is_routed = path[-1] in ("wg", "wu", "wd")
        if path[0] == "mtp":
            mtp += n
            mtp_routed += n if is_routed else 0
            continue
        total += n
        routed += n if is_routed else 0
    inactive = 1 - model_cfg.num_experts_per_tok / model_cfg.n_routed_experts
    return {"total": int(total), "active": int(round(total - routed * inactive)), "mtp": int(mtp),
            "mtp_active": int(round(mtp - mtp_routed * inactive))}
