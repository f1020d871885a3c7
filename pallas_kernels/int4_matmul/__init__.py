"""Int4 weight matmuls: torch-exact dynamic quantization and weight-only modes.

* `base`: the packed format (`PackedInt4Weight`), argument checks and the reference (jnp, exact);
  `dyn_quant`: torch's dynamic-quant numerics it is built from.
* `xla`: pure XLA (any backend; the fallback when the C++ kernel is not built).
* `cpp`: the C++ CPU kernels (``csrc/int4_matmul.cc``, built by ``setup.py``) via the XLA FFI.
* `triton`: Pallas Triton GPU kernels, W4A16 and W4A8 (``interpret=True`` runs them on CPU);
  `triton_config`: their tiles (``Config.heuristics`` / ``Config.search_space``).

No flags here: `jbackends.quantized` chooses among them.
"""
