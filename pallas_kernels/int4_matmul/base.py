"""Int4 matmul: the packed-weight format, argument checks and the reference.

The semantics are those of torch's ``_dyn_quant_pack_4bit_weight`` /
``_dyn_quant_matmul_4bit`` (PyTorch PR 134124, the x86 reference kernels):

* Weights ``[N = out_features, K = in_features]`` are quantized symmetrically
  to 4 bits per group of ``groupsize`` consecutive k (a multiple of 32 that
  divides K; ``groupsize == K`` is channel-wise): ``scale = max|w| / 7`` and
  ``q = round_half_up(w / scale)`` in -7..7 (kernels accept -8..7), stored as
  the unsigned nibble ``q + 8``, two per byte, **the low nibble is the even
  k**: bytes ``[N, K/2]``; scales ``[N, K/groupsize]``.
* ``dyn_quant_matmul`` quantizes every input row to int8 asymmetrically over
  all of K with a range that always contains 0 (KleidiAI ``qai8dx``: ties to
  even for the zero point, away from zero for the values), accumulates
  ``(qa - zp) * q`` in int32 per group, sums the groups in float32 in order,
  each multiplied by its weight scale, multiplies by ``1 / scale``, adds the
  bias and clamps to the finite float32 range. No fused multiply-add anywhere:
  XLA contracts ``a * b + c`` inside a fusion, so every product that the
  reference rounds on its own goes through `rounded_mul`.
* ``weight_only_matmul`` (W4A16 / W4A32) is ``x @ dequantize(w).T`` with no
  activation quantization; float tolerance only.

Everything here is plain ``jnp`` and float32/int32 exact: it is the contract
the XLA, C++ and Pallas implementations are tested against bit for bit. This
module is the facade: the format and its checks live in `packing`, the
reference matmuls in `reference`, the activation quantization and the float
tail of the dyn-quant matmul in `dyn_quant`.
"""

from __future__ import annotations

from .dyn_quant import accumulate_groups, group_dots, quantize_activations, rounded_mul, truncate_to_bfloat16
from .packing import (
    Int4Call,
    PackedInt4Weight,
    check_groupsize,
    check_input,
    check_packed,
    dequantize,
    pack_nibbles,
    quantize_4bit,
    unpack_nibbles,
)
from .reference import dyn_quant_matmul, weight_only_matmul

__all__ = [
    "Int4Call",
    "rounded_mul",
    "PackedInt4Weight",
    "quantize_4bit",
    "pack_nibbles",
    "unpack_nibbles",
    "dequantize",
    "quantize_activations",
    "group_dots",
    "accumulate_groups",
    "dyn_quant_matmul",
    "weight_only_matmul",
    "check_groupsize",
    "check_packed",
    "check_input",
    "truncate_to_bfloat16",
]
