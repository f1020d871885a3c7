"""Tile configs of the Pallas Triton attention kernels and how they are chosen.

Every config class here follows the tuning protocol every kernel config in ``pallas_kernels`` has:

* ``Config.heuristics(args, device=None)``: the default config for the call ``args`` on ``device``
  (a mapping of what is known about the target, as the dispatcher passes it: ``compute_capability``
  as ``9.0`` or ``90``, ``num_sms``; None: the GPU being lowered for);
* ``Config.search_space(args)``: the candidates an autotuner (:mod:`autotune`) may time.

:class:`Config` is the forward config of :mod:`triton_flash` and :mod:`triton_mem_efficient`,
:class:`BackwardConfig` the fused backward's (:mod:`triton_flash_vjp`), :class:`DecodeConfig` the
split-K decode kernel's (:mod:`triton_decode`). The shape-level rules behind ``heuristics`` are the
functions :func:`heuristics`, :func:`backward_heuristics` and :func:`decode_heuristics`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import jax.numpy as jnp

from pallas_kernels import gpu
from pallas_kernels.attention import base, triton_common as common

__all__ = [
    "Config",
    "BackwardConfig",
    "DecodeConfig",
    "heuristics",
    "backward_heuristics",
    "decode_heuristics",
    "device_compute_capability",
]


def device_compute_capability(device: Optional[Mapping[str, Any]] = None) -> Optional[int]:
    """The compute capability (e.g. 90) a protocol ``device`` record names; None: the local GPU's."""
    if device is None:
        return common.local_compute_capability()
    return gpu.compute_capability_of(device)


def _check_launch(cfg, tiles) -> None:
    for name in tiles:
        v = getattr(cfg, name)
        if not isinstance(v, int) or v < 16 or v & (v - 1):
            raise ValueError(f"Config.{name} must be a power of two >= 16; got {name}={v!r}")
    if cfg.num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"Config.num_warps must be one of 1, 2, 4, 8, 16; got {cfg.num_warps=}")
    if not isinstance(cfg.num_stages, int) or cfg.num_stages < 1:
        raise ValueError(f"Config.num_stages must be an int >= 1; got {cfg.num_stages=}")


def _widest(args: base.AttentionArgs) -> tuple:
    """The padded head dim that sizes the tiles, and whether the dtype is 4 bytes wide."""
    return common.pad_dim(max(args.head_dim, args.v_head_dim)), jnp.dtype(args.dtype).itemsize >= 4


@dataclasses.dataclass(frozen=True)
class _Tiles:
    """Tile sizes and launch parameters of a Triton attention kernel.

    Attributes:
      block_q: query rows per program / tile (power of two >= 16; shrunk to the sequence when shorter).
      block_k: keys per inner step / tile (power of two >= 16).
      num_warps: Triton warps per program.
      num_stages: Triton software-pipelining stages.
    """

    block_q: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        _check_launch(self, ("block_q", "block_k"))


@dataclasses.dataclass(frozen=True)
class Config(_Tiles):
    """Tiles of the forward kernel (fields: :class:`_Tiles`; the stages pipeline the key loop)."""

    @classmethod
    def heuristics(cls, args: base.AttentionArgs, device: Optional[Mapping[str, Any]] = None) -> "Config":
        """:func:`heuristics` for the head dim and dtype of ``args`` on ``device``."""
        return heuristics(args.head_dim, args.dtype, device_compute_capability(device))

    @classmethod
    def search_space(cls, args: base.AttentionArgs) -> list:
        """Tiles 64 / 128 x 32 / 64 / 128 (smaller for head dim 256 and float32), 4 / 8 warps,
        2 / 3 stages."""
        hp, wide = _widest(args)
        out = []
        for bq in (64, 128):
            for bk in (32, 64, 128):
                if hp >= 256 and (bq > 64 or bk > 64) or wide and bk > 64:
                    continue
                for warps in (4, 8):
                    for stages in (2, 3):
                        out.append(cls(bq, bk, warps, stages))
        return out


def heuristics(head_dim: int, dtype=jnp.bfloat16, compute_capability: Optional[int] = None) -> Config:
    """A sensible forward :class:`Config` by head dim, dtype and GPU generation.

    Args:
      head_dim: the (unpadded) query/key head dim.
      dtype: input dtype; float32 tiles take twice the shared memory, so they get smaller blocks.
      compute_capability: e.g. 75 (T4), 80 (A100), 90 (H100); None means "Ampere or newer".

    Example:
      >>> from pallas_kernels.attention import triton_tuning
      >>> triton_tuning.heuristics(64).block_q
      128
    """
    cc = 80 if compute_capability is None else compute_capability
    hp = common.pad_dim(head_dim)
    wide = jnp.dtype(dtype).itemsize >= 4
    if cc < 80:  # Turing: 64 KiB shared memory, no async copies.
        if hp > 128 and wide:
            return Config(block_q=32, block_k=16, num_warps=4, num_stages=1)
        return Config(block_q=64, block_k=32 if hp > 64 or wide else 64, num_warps=4, num_stages=1)
    if hp <= 64:
        return Config(block_q=128, block_k=64 if wide else 128, num_warps=4, num_stages=3 if cc >= 90 else 2)
    if hp <= 128:
        return Config(block_q=128, block_k=32 if wide else 64, num_warps=8 if cc >= 90 else 4, num_stages=2)
    if wide:  # float32 at head dim 256: 1 KiB per row
        return Config(block_q=32, block_k=32, num_warps=8 if cc >= 90 else 4, num_stages=2)
    return Config(block_q=64, block_k=32, num_warps=8 if cc >= 90 else 4, num_stages=2)


@dataclasses.dataclass(frozen=True)
class BackwardConfig(_Tiles):
    """Tiles of the fused backward kernel (fields: :class:`_Tiles`); smaller default tiles."""

    block_q: int = 64

    @classmethod
    def heuristics(
        cls, args: base.AttentionArgs, device: Optional[Mapping[str, Any]] = None
    ) -> "BackwardConfig":
        """:func:`backward_heuristics` for the head dim and dtype of ``args`` on ``device``."""
        return backward_heuristics(args.head_dim, args.dtype, device_compute_capability(device))

    @classmethod
    def search_space(cls, args: base.AttentionArgs) -> list:
        """Tiles 32 / 64 x 32 / 64 / 128 (smaller for head dim 256 and float32), 4 / 8 warps."""
        hp, wide = _widest(args)
        out = []
        for bq in (32, 64):
            for bk in (32, 64, 128):
                if hp >= 256 and bk > 32 or wide and bk > 64:
                    continue
                for warps in (4, 8):
                    out.append(cls(bq, bk, warps, 2 if hp <= 128 else 1))
        return out


def backward_heuristics(
    head_dim: int, dtype=jnp.bfloat16, compute_capability: Optional[int] = None
) -> BackwardConfig:
    """A sensible :class:`BackwardConfig` by head dim, dtype and GPU generation.

    The backward keeps K, V, dK, dV and a Q / dO tile on chip, so its tiles are smaller than the
    forward's.

    Example:
      >>> from pallas_kernels.attention import triton_tuning
      >>> triton_tuning.backward_heuristics(128).num_warps
      8
    """
    cc = 80 if compute_capability is None else compute_capability
    hp = common.pad_dim(head_dim)
    wide = jnp.dtype(dtype).itemsize >= 4
    if cc < 80:  # Turing: 64 KiB shared memory
        if hp > 128 and wide:
            return BackwardConfig(block_q=16, block_k=16, num_warps=4, num_stages=1)
        return BackwardConfig(block_q=32, block_k=32, num_warps=4, num_stages=1)
    if hp <= 64:
        return BackwardConfig(block_q=64, block_k=64 if not wide else 32, num_warps=4, num_stages=2)
    if hp <= 128:
        return BackwardConfig(
            block_q=64 if not wide else 32, block_k=64 if not wide else 32, num_warps=8, num_stages=2
        )
    return BackwardConfig(block_q=32, block_k=32, num_warps=8, num_stages=1)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the split-K decode kernel.

    Attributes:
      block_k: keys per inner step (power of two >= 16).
      num_splits: key chunks processed in parallel (0 = choose from the shape, see
        :func:`decode_heuristics`).
      num_warps, num_stages: Triton warps per program and pipelining stages.
    """

    block_k: int = 64
    num_splits: int = 0
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if not isinstance(self.num_splits, int) or self.num_splits < 0:
            raise ValueError(f"Config.num_splits must be an int >= 0 (0 = auto); got {self.num_splits=}")
        _check_launch(self, ("block_k",))

    @classmethod
    def heuristics(
        cls, args: base.AttentionArgs, device: Optional[Mapping[str, Any]] = None
    ) -> "DecodeConfig":
        """:func:`decode_heuristics` for ``args`` (its ``B * K`` programs and ``S`` keys) on ``device``."""
        extra = {} if device is None or "num_sms" not in device else {"num_sms": int(device["num_sms"])}
        return decode_heuristics(
            args.head_dim,
            args.dtype,
            device_compute_capability(device),
            batch_kv_heads=args.batch * args.num_kv_heads,
            kv_len=args.kv_len,
            **extra,
        )

    @classmethod
    def search_space(cls, args: base.AttentionArgs) -> list:
        """Key blocks 32 / 64, 0 (auto) / 4 / 16 / 32 splits, 4 / 8 warps."""
        del args
        return [cls(bk, splits, warps, 2) for bk in (32, 64) for splits in (0, 4, 16, 32) for warps in (4, 8)]


def decode_heuristics(
    head_dim: int,
    dtype=jnp.bfloat16,
    compute_capability: Optional[int] = None,
    *,
    batch_kv_heads: int = 1,
    kv_len: int = 4096,
    num_sms: int = 108,
) -> DecodeConfig:
    """A :class:`DecodeConfig`: enough splits for ~2 waves of programs, >= 4 key blocks per split.

    Example:
      >>> from pallas_kernels.attention import triton_tuning
      >>> triton_tuning.decode_heuristics(128, batch_kv_heads=8, kv_len=32768).num_splits
      27
    """
    cc = 80 if compute_capability is None else compute_capability
    hp = common.pad_dim(head_dim)
    wide = jnp.dtype(dtype).itemsize >= 4
    block_k = 32 if (hp > 128 or wide or cc < 80) else 64
    max_splits = max(1, -(-kv_len // (4 * block_k)))
    want = max(1, -(-2 * num_sms // max(1, batch_kv_heads)))
    splits = int(min(max_splits, want, 128))
    return DecodeConfig(
        block_k=block_k, num_splits=splits, num_warps=4 if hp <= 128 else 8, num_stages=2 if cc >= 80 else 1
    )
