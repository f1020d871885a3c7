"""The main demo (`python -m jbackends.examples.train_gpt`) with a reduced step count.

* the whole command runs: loss decreases, the loss-curve PNG is written, int4 greedy generation
  produces text and the int4 model's validation loss stays near the float one;
* the flash and the math train steps agree over the first steps (losses and parameters), and the
  dispatch log shows which backend each one traced.
"""

import logging
import os

import jax
import numpy as np
import pytest
from flax import nnx

import jbackends as jb
from jbackends.examples import train_gpt as tg


def test_demo_main_short_run(tmp_path, capsys):
    result = tg.main(["--steps", "40", "--out", str(tmp_path), "--no-progress", "--seed", "0"])
    out = capsys.readouterr().out

    losses = np.asarray(result["losses"])
    assert losses.shape == (40,) and np.isfinite(losses).all()
    # Uniform over 128 symbols is ln(128) = 4.85 nats; 40 steps must take off well over a nat.
    assert losses[0] == pytest.approx(np.log(128), abs=0.3)
    assert losses[-5:].mean() < losses[0] - 1.2, losses
    assert result["val_loss"] < losses[0] - 1.0

    png = result["png"]
    assert os.path.dirname(png) == str(tmp_path) and os.path.getsize(png) > 10_000
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert "loss curve:" in out and "tokens/s" in out and "FLASH_ATTENTION" in out

    assert result["tokens_per_s"] > 0
    assert result["float_decode_tokens_per_s"] > 0 and result["int4_decode_tokens_per_s"] > 0
    seq_len = tg.GPTConfig().seq_len
    for prompt, text in zip(tg.PROMPTS, result["int4_texts"]):
        assert len(text) == seq_len and text.startswith(prompt)
        generated = text[len(prompt) :]
        assert all(c.isprintable() or c == "\n" for c in generated), repr(generated)
        assert sum(c.isalpha() for c in generated) > len(generated) // 3, repr(generated)
    # int4 with groups of 32 costs little accuracy on this model.
    assert result["int4_val_loss"] == pytest.approx(result["val_loss"], abs=0.15)


def _params(model):
    return jax.tree.map(np.asarray, nnx.state(model, nnx.Param))


def test_flash_and_math_first_steps_agree(caplog):
    cfg = tg.GPTConfig(n_layers=2, seq_len=64)  # a shape no other test traced: the log shows the dispatch
    steps = tg.TrainConfig(steps=4, batch_size=8)
    with caplog.at_level(logging.INFO, logger="jbackends"), jb.verbose(1):
        m_flash, h_flash = tg.train(cfg, steps, backend="flash", progress=False)
        flash_log = caplog.text
        caplog.clear()
        m_math, h_math = tg.train(cfg, steps, backend="math", progress=False)
        math_log = caplog.text
    assert "chosen=FLASH_ATTENTION" in flash_log and "chosen=MATH" not in flash_log, flash_log
    assert "chosen=MATH" in math_log and "chosen=FLASH_ATTENTION" not in math_log, math_log

    np.testing.assert_allclose(h_flash.losses, h_math.losses, rtol=2e-5)
    assert h_flash.losses[-1] < h_flash.losses[0]
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=2e-5), _params(m_flash), _params(m_math)
    )
    assert h_flash.val_loss == pytest.approx(h_math.val_loss, rel=1e-4)


def test_generation_shares_prompt_and_is_deterministic():
    model = tg.GPT(tg.GPTConfig(n_layers=1), rngs=nnx.Rngs(0))
    texts, tps = tg.generate(model, ["ab", "Hello"])
    again, _ = tg.generate(model, ["ab", "Hello"])
    assert texts == again and tps > 0
    assert texts[0].startswith("ab") and texts[1].startswith("Hello")
    assert [len(t) for t in texts] == [model.cfg.seq_len] * 2


def test_kv_cache_decode_matches_full_forward():
    """The decode path (KV cache, one position at a time) computes the same logits as the full model."""
    cfg = tg.GPTConfig(n_layers=2, seq_len=32)
    model = tg.GPT(cfg, rngs=nnx.Rngs(1))
    tokens = jax.numpy.asarray(tg.encode(tg.TEXT[: cfg.seq_len])[None])
    full = np.asarray(model(tokens))[0]
    step = nnx.jit(lambda m, token, pos, caches: m.decode_step(token, pos, caches))
    caches = [
        (jax.numpy.zeros((1, cfg.seq_len, cfg.n_heads, cfg.head_dim)),) * 2 for _ in range(cfg.n_layers)
    ]
    for pos in range(cfg.seq_len):
        logits, caches = step(model, tokens[:, pos], pos, caches)
        np.testing.assert_allclose(np.asarray(logits)[0], full[pos], atol=1e-4, rtol=1e-4, err_msg=f"{pos=}")
    # eager, with a Python int position (it raised AttributeError in the position embedding)
    caches = [
        (jax.numpy.zeros((1, cfg.seq_len, cfg.n_heads, cfg.head_dim)),) * 2 for _ in range(cfg.n_layers)
    ]
    for pos in range(2):
        logits, caches = model.decode_step(tokens[:, pos], pos, caches)
        np.testing.assert_allclose(np.asarray(logits)[0], full[pos], atol=1e-4, rtol=1e-4, err_msg=f"{pos=}")
