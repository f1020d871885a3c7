"""Train a small character-level GPT with jbackends, then decode it in int4.

    python -m jbackends.examples.train_gpt            # ~300 steps, a few minutes on a laptop CPU
    python -m jbackends.examples.train_gpt --steps 100 --out runs/gpt --seed 1
    jbackends-demo --steps 100                        # the same, as a console script

What it shows, end to end:

1. A flax nnx GPT (`gpt.py`, with its decoding) whose one attention call is `jb.dot_product_attention`
   (the drop-in for `jax.nn.dot_product_attention`; the backend is picked from the flags in force when
   it is traced).
2. A train step decorated with `@jb.with_backends(flash=True)`: FlashAttention-2 (Pallas on GPU, the
   blockwise XLA engine on CPU) in the forward and the backward, chosen at trace time.
3. A progress bar with the loss and tokens/s, and a loss-curve PNG at the end.
4. `jb.nn.quantize_4bit(model, groupsize=32)`: every `nnx.Linear` becomes an int4 layer; greedy decoding
   with a KV cache, float vs int4 (decode speed and validation loss of both).

The corpus (`corpus.py`) is about 8 KB of public-domain poems and speeches, shipped in the package; the
vocabulary is the 128 ASCII codes, so there is no tokenizer. Defaults are the same on CPU and GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jbackends as jb
from jbackends.examples.corpus import TEXT
from jbackends.examples.gpt import Block as Block  # the model, its vocabulary and decoding: `gpt.py`
from jbackends.examples.gpt import GPT, GPTConfig, attention, decode, encode, generate, quantize

__all__ = ["GPT", "GPTConfig", "TrainConfig", "attention", "encode", "decode", "generate", "main", "train"]


# --------------------------------------------------------------------------------------------------
# Training configuration (the model's, `GPTConfig`, is in `gpt.py`).
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 300
    batch_size: int = 16
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.1
    seed: int = 0


# --------------------------------------------------------------------------------------------------
# Data: bytes of the corpus, random windows.
# --------------------------------------------------------------------------------------------------


def split_corpus(text: str = TEXT, val_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    tokens = encode(text)
    n_val = int(len(tokens) * val_fraction)
    return tokens[:-n_val], tokens[-n_val:]


def batches(tokens: np.ndarray, batch_size: int, seq_len: int, seed: int):
    """Endless random windows of `seq_len + 1` tokens (inputs and shifted targets)."""
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch_size)
        yield np.stack([tokens[s : s + seq_len + 1] for s in starts])


def eval_windows(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """Non-overlapping windows covering `tokens` (the validation set)."""
    n = (len(tokens) - 1) // seq_len
    return np.stack([tokens[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])


# --------------------------------------------------------------------------------------------------
# Training.
# --------------------------------------------------------------------------------------------------


def loss_fn(model: GPT, batch):
    logits = model(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


@jb.with_backends(flash=True)  # FlashAttention-2 for every attention traced in here, forward and backward
@nnx.jit
def train_step(model: GPT, optimizer: nnx.Optimizer, batch):
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss


# The same step with only the reference attention allowed (the flags are part of the jit key, so the
# one `nnx.jit` function above compiles a second executable for this scope).
math_train_step = jb.with_backends(flash=False, mem_efficient=False, cudnn=False, math=True)(
    train_step.__wrapped__
)

eval_loss = nnx.jit(loss_fn)


def make_optimizer(model: GPT, cfg: TrainConfig) -> nnx.Optimizer:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.learning_rate, cfg.warmup_steps, max(cfg.steps, cfg.warmup_steps + 1), cfg.learning_rate / 10
    )
    tx = optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.99, weight_decay=cfg.weight_decay)
    )
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


@dataclasses.dataclass
class History:
    losses: list[float]
    tokens_per_s: float  # steady state: excludes the first (compiling) step
    compile_s: float
    train_s: float
    val_loss: float


def train(
    model_cfg: GPTConfig = GPTConfig(),
    train_cfg: TrainConfig = TrainConfig(),
    *,
    backend: str = "flash",
    progress: bool = True,
) -> tuple[GPT, History]:
    """Train from scratch; `backend` is "flash" (the demo) or "math" (the reference, for comparison)."""
    if backend not in ("flash", "math"):
        raise ValueError(f"backend must be one of ['flash', 'math'], got {backend!r}")
    step_fn = train_step if backend == "flash" else math_train_step
    train_tokens, val_tokens = split_corpus()
    model = GPT(model_cfg, rngs=nnx.Rngs(train_cfg.seed))
    optimizer = make_optimizer(model, train_cfg)
    data = batches(train_tokens, train_cfg.batch_size, model_cfg.seq_len, train_cfg.seed)
    tokens_per_step = train_cfg.batch_size * model_cfg.seq_len

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=train_cfg.steps, desc=f"train ({backend})", unit="step", dynamic_ncols=True)
    losses: list[float] = []
    compile_s = 0.0
    t_start = time.perf_counter()
    for step in range(train_cfg.steps):
        t0 = time.perf_counter()
        loss = float(step_fn(model, optimizer, jnp.asarray(next(data))))
        if step == 0:
            compile_s = time.perf_counter() - t0
            t_start = time.perf_counter()
        losses.append(loss)
        if bar is not None:
            done = step  # steps after the compiling one
            elapsed = time.perf_counter() - t_start
            tps = done * tokens_per_step / elapsed if done and elapsed > 0 else float("nan")
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps:,.0f}")
            bar.update(1)
    train_s = time.perf_counter() - t_start
    if bar is not None:
        bar.close()
    steady = train_cfg.steps - 1
    tokens_per_s = steady * tokens_per_step / train_s if steady > 0 and train_s > 0 else float("nan")
    val = validation_loss(model, val_tokens)
    return model, History(losses, tokens_per_s, compile_s, train_s, val)


def validation_loss(model, val_tokens: np.ndarray | None = None) -> float:
    if val_tokens is None:
        val_tokens = split_corpus()[1]
    return float(eval_loss(model, jnp.asarray(eval_windows(val_tokens, model.cfg.seq_len))))


# --------------------------------------------------------------------------------------------------
# Plot and command line.
# --------------------------------------------------------------------------------------------------


def plot_losses(losses: Sequence[float], val_loss: float, path: str, title: str = "") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    steps = np.arange(1, len(losses) + 1)
    ax.plot(steps, losses, lw=1, alpha=0.5, label="train loss")
    if len(losses) >= 10:
        w = max(len(losses) // 20, 2)
        smooth = np.convolve(losses, np.ones(w) / w, mode="valid")
        ax.plot(steps[w - 1 :], smooth, lw=2, label=f"train loss ({w}-step mean)")
    ax.axhline(val_loss, color="k", ls="--", lw=1, label=f"validation loss {val_loss:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/char)")
    ax.set_title(title or "char-level GPT, jbackends flash attention")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


PROMPTS = ("Shall I compare", "To be, or not", "Tyger Tyger, ", "Four score and")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m jbackends.examples.train_gpt", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--steps", type=int, default=TrainConfig.steps, help="training steps (default %(default)s)"
    )
    parser.add_argument("--out", default="out", help="directory for loss_curve.png (default ./%(default)s)")
    parser.add_argument("--seed", type=int, default=TrainConfig.seed, help="parameter and data seed")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (logs, CI)")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps must be >= 2, got {args.steps}")

    model_cfg = GPTConfig()
    train_cfg = TrainConfig(steps=args.steps, seed=args.seed)
    dev = jax.devices()[0]
    print(f"jbackends {jb.__version__} | jax {jax.__version__} | {dev.platform} ({dev.device_kind})")
    print(f"corpus: {len(TEXT):,} chars | model: {model_cfg} | batch {train_cfg.batch_size}")
    print("attention:", _backend_summary(model_cfg, train_cfg.batch_size, len(PROMPTS)))

    model, hist = train(model_cfg, train_cfg, progress=not args.no_progress)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(
        f"trained {args.steps} steps ({n_params:,} params): loss {hist.losses[0]:.3f} -> {hist.losses[-1]:.3f}, "
        f"validation {hist.val_loss:.3f} | {hist.tokens_per_s:,.0f} tokens/s (first step, compile: {hist.compile_s:.1f} s)"
    )
    os.makedirs(args.out, exist_ok=True)
    png = plot_losses(hist.losses, hist.val_loss, os.path.join(args.out, "loss_curve.png"))
    print(f"loss curve: {os.path.abspath(png)}")

    float_texts, float_tps = generate(model, PROMPTS)
    qmodel = quantize(model, groupsize=32)
    int4_texts, int4_tps = generate(qmodel, PROMPTS)
    int4_val = validation_loss(qmodel)
    print(f"\ngreedy decoding, batch {len(PROMPTS)}, KV cache, {model_cfg.seq_len} positions per row:")
    print(f"  float32 weights: {float_tps:,.0f} tokens/s, validation loss {hist.val_loss:.3f}")
    print(
        f"  int4 weights:    {int4_tps:,.0f} tokens/s, validation loss {int4_val:.3f} "
        f"(int4 / float speed: {int4_tps / float_tps:.2f}x)"
    )
    print("\nint4 samples:")
    for text in int4_texts:
        print("  | " + text.replace("\n", "\n  | "))
    return {
        "losses": hist.losses,
        "val_loss": hist.val_loss,
        "int4_val_loss": int4_val,
        "tokens_per_s": hist.tokens_per_s,
        "compile_s": hist.compile_s,
        "png": png,
        "float_texts": float_texts,
        "int4_texts": int4_texts,
        "float_decode_tokens_per_s": float_tps,
        "int4_decode_tokens_per_s": int4_tps,
        "n_params": n_params,
    }


def _backend_summary(model_cfg: GPTConfig, batch_size: int, n_rows: int) -> str:
    """Which SDPA backend the train step and the decode step get, asked of jbackends up front."""
    n, h, t = model_cfg.n_heads, model_cfg.head_dim, model_cfg.seq_len
    seq = jax.ShapeDtypeStruct((batch_size, t, n, h), jnp.float32)
    with jb.with_backends(flash=True):  # the train step's scope
        train = jb.explain(seq, seq, seq, is_causal=True)
    one = jax.ShapeDtypeStruct((n_rows, 1, n, h), jnp.float32)
    cache = jax.ShapeDtypeStruct((n_rows, t, n, h), jnp.float32)
    lengths = jax.ShapeDtypeStruct((n_rows,), jnp.int32)
    dec = jb.explain(one, cache, cache, key_value_seq_lengths=lengths)
    return (
        f"train step -> {train.chosen.name} ({train.implementation}); "
        f"decode step -> {dec.chosen.name} ({dec.implementation})"
    )


def cli() -> None:
    """Console-script entry point (`jbackends-demo`)."""
    main(sys.argv[1:])


if __name__ == "__main__":
    cli()
