"""The model of the demo (`train_gpt.py`): a small character-level GPT in flax nnx, and its decoding.

* `GPTConfig`, `Block`, `GPT`: a pre-LayerNorm transformer whose one attention call, `attention`, is
  `jb.dot_product_attention` (the drop-in for `jax.nn.dot_product_attention`; the backend is picked
  from the flags in force when it is traced).
* `encode` / `decode`: the vocabulary is the 128 ASCII codes, so there is no tokenizer.
* `generate`: greedy decoding with a KV cache (float or int4 weights: the same code); `quantize`: an
  int4 copy of a model (`jb.nn.quantize_4bit`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jbackends as jb

__all__ = ["GPT", "Block", "GPTConfig", "attention", "encode", "decode", "generate", "quantize"]


# --------------------------------------------------------------------------------------------------
# Configuration and vocabulary.
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Model shape. Every Linear has in/out features that are multiples of 32 (int4 groups of 32)."""

    vocab_size: int = 128  # the ASCII codes
    seq_len: int = 128
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 3
    mlp_ratio: int = 4

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("ascii"), dtype=np.uint8).astype(np.int32)


def decode(tokens: Any) -> str:
    return bytes(int(t) for t in np.asarray(tokens).reshape(-1)).decode("ascii", errors="replace")


# --------------------------------------------------------------------------------------------------
# The model.
# --------------------------------------------------------------------------------------------------


def attention(query, key, value, *, is_causal: bool = False, key_value_seq_lengths=None):
    """The model's one attention call: `jb.dot_product_attention`, the drop-in for
    `jax.nn.dot_product_attention` (layout BTNH).

    Which backend runs (flash, mem_efficient, cudnn, math) is decided from the jbackends flags in force
    while this is traced; `jb.explain(...)` says which and why.
    """
    return jb.dot_product_attention(
        query, key, value, is_causal=is_causal, key_value_seq_lengths=key_value_seq_lengths
    )


class Block(nnx.Module):
    """Pre-LayerNorm transformer block: causal self-attention and a GELU MLP."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        d, hidden = cfg.d_model, cfg.mlp_ratio * cfg.d_model
        out_init = nnx.initializers.normal(0.02 / math.sqrt(2 * cfg.n_layers))
        self.n_heads = cfg.n_heads
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.qkv = nnx.Linear(d, 3 * d, use_bias=False, rngs=rngs)
        self.proj = nnx.Linear(d, d, use_bias=False, kernel_init=out_init, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.fc = nnx.Linear(d, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, d, kernel_init=out_init, rngs=rngs)

    def _qkv(self, x):
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).reshape(b, t, 3, self.n_heads, d // self.n_heads)
        return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]

    def _finish(self, x, y):
        b, t = y.shape[:2]
        x = x + self.proj(y.reshape(b, t, -1))
        return x + self.out(jax.nn.gelu(self.fc(self.ln2(x))))

    def __call__(self, x):
        q, k, v = self._qkv(x)
        return self._finish(x, attention(q, k, v, is_causal=True))

    def decode(self, x, k_cache, v_cache, pos):
        """One token per row at position `pos`; the caches are [B, seq_len, N, H]."""
        q, k, v = self._qkv(x)
        k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, k.astype(k_cache.dtype), pos, axis=1)
        v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache, v.astype(v_cache.dtype), pos, axis=1)
        # Keys 0..pos are visible: a length per row (an index mask, which the flash backend takes).
        lengths = jnp.full((x.shape[0],), pos + 1, jnp.int32)
        return (
            self._finish(x, attention(q, k_cache, v_cache, key_value_seq_lengths=lengths)),
            k_cache,
            v_cache,
        )


class GPT(nnx.Module):
    """A small GPT: token + learned position embeddings, `n_layers` blocks, a final LayerNorm, a head."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        embed_init = nnx.initializers.normal(0.02)
        self.tok_emb = nnx.Embed(cfg.vocab_size, cfg.d_model, embedding_init=embed_init, rngs=rngs)
        self.pos_emb = nnx.Embed(cfg.seq_len, cfg.d_model, embedding_init=embed_init, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.ln_f = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, kernel_init=embed_init, rngs=rngs)

    def __call__(self, tokens):
        """tokens [B, T] (T <= seq_len) -> logits [B, T, vocab]."""
        x = self.tok_emb(tokens) + self.pos_emb(jnp.arange(tokens.shape[1]))[None]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def decode_step(self, token, pos, caches):
        """token [B] at position `pos` (an int or an int array) -> (logits [B, vocab], updated caches)."""
        pos = jnp.asarray(pos, jnp.int32)
        x = self.tok_emb(token[:, None]) + self.pos_emb(pos)[None, None]
        new_caches = []
        for block, (k_cache, v_cache) in zip(self.blocks, caches):
            x, k_cache, v_cache = block.decode(x, k_cache, v_cache, pos)
            new_caches.append((k_cache, v_cache))
        return self.head(self.ln_f(x))[:, 0], new_caches


# --------------------------------------------------------------------------------------------------
# Greedy decoding with a KV cache (float or int4 weights: the same code, the Linear layers differ).
# --------------------------------------------------------------------------------------------------


@nnx.jit
def _generate(model: GPT, prompt_tokens, prompt_lengths):
    """prompt_tokens [B, seq_len] (zero padded), prompt_lengths [B] -> tokens [B, seq_len].

    One `lax.scan` over positions: row i reads its prompt while `pos < prompt_lengths[i]` and its own
    greedy prediction after that, so prefill and generation share one compiled decode step.
    """
    cfg = model.cfg
    b = prompt_tokens.shape[0]
    dtype = model.tok_emb.embedding[...].dtype
    caches = [
        (jnp.zeros((b, cfg.seq_len, cfg.n_heads, cfg.head_dim), dtype),) * 2 for _ in range(cfg.n_layers)
    ]

    def body(carry, pos):
        token, caches = carry
        token = jnp.where(pos < prompt_lengths, prompt_tokens[:, pos], token)
        logits, caches = model.decode_step(token, pos, caches)
        nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return (nxt, caches), token

    init = (jnp.zeros((b,), jnp.int32), caches)
    (last, _), seen = jax.lax.scan(body, init, jnp.arange(cfg.seq_len - 1))
    return jnp.concatenate([seen.T, last[:, None]], axis=1)


def generate(model: GPT, prompts: Sequence[str], *, repeats: int = 3) -> tuple[list[str], float]:
    """Greedy continuation of each prompt up to `seq_len` characters; returns (texts, decode tokens/s).

    Tokens/s counts every position of every row (prefill included), best of `repeats` compiled calls.
    """
    cfg = model.cfg
    arr = np.zeros((len(prompts), cfg.seq_len), np.int32)
    for i, p in enumerate(prompts):
        enc = encode(p)[: cfg.seq_len - 1]
        arr[i, : len(enc)] = enc
    lengths = jnp.asarray([min(len(p), cfg.seq_len - 1) for p in prompts], jnp.int32)
    arr = jnp.asarray(arr)
    out = jax.block_until_ready(_generate(model, arr, lengths))  # compile
    elapsed = float("inf")
    for _ in range(repeats):  # best of `repeats` (a shared machine adds noise, never speed)
        t0 = time.perf_counter()
        out = jax.block_until_ready(_generate(model, arr, lengths))
        elapsed = min(elapsed, time.perf_counter() - t0)
    texts = [decode(row) for row in np.asarray(out)]
    return texts, len(prompts) * cfg.seq_len / elapsed


def quantize(model: GPT, groupsize: int = 32) -> GPT:
    """An int4 copy of `model` (every nnx.Linear -> int4 weights, groups of `groupsize`)."""
    return jb.nn.quantize_4bit(nnx.clone(model), groupsize=groupsize)
