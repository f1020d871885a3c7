"""`jb.fft.*` and `jb.cuda.cufft_plan_cache`: an LRU cache of compiled FFT executables per device.

torch keeps a cache of cuFFT plans per CUDA device. In JAX a cuFFT plan lives inside the compiled
executable of the FFT (XLA creates the plan when the executable first runs and keeps it with the
executable; on CPU the executable holds its DUCC plan). So the JAX meaning of "the plan cache" is a
cache of compiled FFT executables, keyed by everything that changes the plan:

    (function, shape, dtype, n / s, axis / axes, norm, device)

`jb.fft.fft(x, ...)` on a concrete array looks its key up in the cache of `x`'s device, compiles on a
miss (`jax.jit(...).lower(...).compile()`) and runs the executable; the least recently used entry is
dropped when `max_size` is exceeded (dropping the executable frees its plans). Inside a trace (under
`jax.jit`, `grad`, `vmap`) the call is plain `jnp.fft.*`: the enclosing executable owns its plans, and
the cache is not involved. Arrays sharded over several devices also take the plain path.

The cache per device (`cufft_plan_cache[i]`, `i` indexing `jax.devices()`) has `size` (read-only),
`max_size` (settable, torch's default 4096; 0 disables caching) and `clear()`. Without an index the
attributes refer to the default device, as torch's refer to the current device.
"""

from __future__ import annotations

import collections
import functools
import operator
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from jbackends._src import verbose as _verbose
from jbackends._src.arrays import check_arraylike

DEFAULT_MAX_SIZE = 4096  # torch's default for CUDA >= 10
_NORMS = (None, "backward", "ortho", "forward")


class PlanCache:
    """The compiled-FFT cache of one device (torch: `cufft_plan_cache[device_index]`)."""

    def __init__(self, device: Any):
        self.device = device
        self._entries: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
        self._max_size = DEFAULT_MAX_SIZE
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def size(self) -> int:
        """Number of compiled FFT executables currently cached (read-only, as in torch)."""
        return len(self._entries)

    @property
    def max_size(self) -> int:
        """Capacity; assigning a smaller value evicts least recently used entries, 0 disables caching."""
        return self._max_size

    @max_size.setter
    def max_size(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"max_size must be an int >= 0, got {type(value).__name__} {value!r}")
        if value < 0:
            raise ValueError(f"max_size must be an int >= 0, got {value}")
        with self._lock:
            self._max_size = value
            self._evict()

    def clear(self) -> None:
        """Drop every cached executable (and with it its FFT plans); resets `hits` / `misses`."""
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = 0

    def keys(self) -> list[tuple]:
        """The cached keys, least recently used first."""
        with self._lock:
            return list(self._entries)

    def _evict(self) -> None:
        while len(self._entries) > self._max_size:
            self._entries.popitem(last=False)

    def get(self, key: tuple, build: Any) -> tuple[Any, bool]:
        """(executable, hit) for `key`, compiling with `build()` on a miss."""
        with self._lock:
            exe = self._entries.get(key)
            if exe is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return exe, True
            self.misses += 1
        exe = build()  # compile outside the lock
        with self._lock:
            if self._max_size > 0:
                self._entries[key] = exe
                self._entries.move_to_end(key)
                self._evict()
        return exe, False

    def __repr__(self) -> str:
        return f"<jbackends cufft_plan_cache device={self.device} size={self.size} max_size={self.max_size}>"


class PlanCacheManager:
    """`jb.cuda.cufft_plan_cache`: one `PlanCache` per device of `jax.devices()`.

    Example:
      >>> import jax.numpy as jnp, jbackends as jb
      >>> jb.cuda.cufft_plan_cache.clear()
      >>> _ = jb.fft.rfft(jnp.ones(8))
      >>> jb.cuda.cufft_plan_cache.size
      1
      >>> jb.cuda.cufft_plan_cache.clear()
    """

    def __init__(self):
        self._caches: dict[Any, PlanCache] = {}
        self._lock = threading.Lock()

    def for_device(self, device: Any) -> PlanCache:
        with self._lock:
            cache = self._caches.get(device)
            if cache is None:
                cache = self._caches[device] = PlanCache(device)
            return cache

    def __getitem__(self, device: int | Any) -> PlanCache:
        if isinstance(device, jax.Device):
            return self.for_device(device)
        if isinstance(device, bool) or not isinstance(device, int):
            raise TypeError(
                f"cufft_plan_cache index must be an int device index or a jax.Device, "
                f"got {type(device).__name__} {device!r}"
            )
        devices = jax.devices()
        if not -len(devices) <= device < len(devices):
            raise IndexError(
                f"cufft_plan_cache: device index {device} out of range for "
                f"{len(devices)} device(s) of jax.devices()"
            )
        return self.for_device(devices[device])

    def _default(self) -> PlanCache:
        device = jax.config.jax_default_device
        if device is None or isinstance(device, str):
            device = jax.devices(device)[0] if isinstance(device, str) else jax.devices()[0]
        return self.for_device(device)

    @property
    def size(self) -> int:
        """Entries cached for the default device."""
        return self._default().size

    @property
    def max_size(self) -> int:
        """Capacity of the default device's cache (settable)."""
        return self._default().max_size

    @max_size.setter
    def max_size(self, value: int) -> None:
        self._default().max_size = value

    def clear(self) -> None:
        """Clear the default device's cache (use `[i].clear()` for another device)."""
        self._default().clear()

    def __repr__(self) -> str:
        return f"<jbackends cufft_plan_cache default={self._default()!r}>"


cufft_plan_cache = PlanCacheManager()


# --------------------------------------------------------------------------------------------------
# The jb.fft wrappers.
# --------------------------------------------------------------------------------------------------


def _ints(value: Any, name: str) -> Any:
    """``value`` as an int or a tuple of ints, as jnp.fft takes it (Python or NumPy integers, a
    sequence or a 1-D integer array of them); anything else (a float, a bool) is a TypeError naming
    ``name``: ``int()`` would truncate 2.9 to 2 and run a transform nobody asked for."""

    def one(v: Any) -> int:
        if not isinstance(v, (bool, np.bool_)):
            try:
                return operator.index(v)
            except TypeError:
                pass
        raise TypeError(f"{name} must be an int or a sequence of ints, got {type(v).__name__} {v!r}")

    if isinstance(value, np.ndarray) and value.ndim == 1:
        return tuple(one(v) for v in value)
    if isinstance(value, Sequence) and not isinstance(value, str):
        return tuple(one(v) for v in value)
    return one(value)


def _canon_axes(value: Any, ndim: int, name: str) -> Any:
    if value is None:
        return None
    value = _ints(value, name)
    for v in value if isinstance(value, tuple) else (value,):
        if not -ndim <= v < ndim:
            raise ValueError(f"{name}={v} is out of range for an array of rank {ndim}")
    return tuple(v % ndim for v in value) if isinstance(value, tuple) else value % ndim


def _canon_sizes(value: Any, name: str) -> Any:
    return None if value is None else _ints(value, name)


def _run(fn_name: str, a: Any, size_name: str, size: Any, axis_name: str, axis: Any, norm: Any) -> Any:
    if norm not in _NORMS:
        raise ValueError(f"norm must be one of {list(_NORMS)}, got {norm!r}")
    check_arraylike(f"jb.fft.{fn_name}", "a", a)
    jnp_fn = getattr(jnp.fft, fn_name)
    kwargs = {size_name: size, axis_name: axis, "norm": norm}
    if isinstance(a, jax.core.Tracer):
        return jnp_fn(a, **kwargs)
    a = jnp.asarray(a)
    devices = a.devices()
    if len(devices) != 1:
        _verbose.report_dispatch(
            f"fft.{fn_name}", "jnp", {"plan_cache": "array spans several devices"}, (a.shape,), (a.dtype,)
        )
        return jnp_fn(a, **kwargs)
    (device,) = devices
    kwargs[size_name] = _canon_sizes(size, size_name)
    kwargs[axis_name] = _canon_axes(axis, a.ndim, axis_name)
    key = (fn_name, a.shape, str(a.dtype), kwargs[size_name], kwargs[axis_name], norm, device)
    cache = cufft_plan_cache.for_device(device)

    def build() -> Any:
        spec = jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=SingleDeviceSharding(device))
        return jax.jit(functools.partial(jnp_fn, **kwargs)).lower(spec).compile()

    exe, hit = cache.get(key, build)
    _verbose.report_dispatch(
        f"fft.{fn_name}", "plan_cache:hit" if hit else "plan_cache:compiled", {}, (a.shape,), (a.dtype,)
    )
    return _verbose.call(f"fft.{fn_name}", exe, a)


def _one_axis(fn_name: str):
    def f(a: Any, n: int | None = None, axis: int = -1, norm: str | None = None) -> Any:
        return _run(fn_name, a, "n", n, "axis", axis, norm)

    f.__name__ = fn_name
    f.__qualname__ = fn_name
    f.__doc__ = (
        f"`jnp.fft.{fn_name}` through the compiled-FFT cache (`jb.cuda.cufft_plan_cache`).\n\n"
        "    Same arguments as `jnp.fft.{0}`. On a concrete single-device array the compiled executable is\n"
        "    cached per (shape, dtype, n, axis, norm, device); under a trace this is plain `jnp.fft.{0}`.\n\n"
        "    Example:\n"
        "      >>> import jax.numpy as jnp, jbackends as jb\n"
        f"      >>> jb.fft.{fn_name}(jnp.ones(8)).shape[0] > 0\n"
        "      True\n"
    ).format(fn_name)
    return f


def _multi_axis(fn_name: str, default_axes: Any):
    def f(
        a: Any,
        s: Sequence[int] | None = None,
        axes: Sequence[int] | None = default_axes,
        norm: str | None = None,
    ) -> Any:
        return _run(fn_name, a, "s", s, "axes", axes, norm)

    f.__name__ = fn_name
    f.__qualname__ = fn_name
    f.__doc__ = (
        f"`jnp.fft.{fn_name}` through the compiled-FFT cache (`jb.cuda.cufft_plan_cache`).\n\n"
        "    Same arguments as `jnp.fft.{0}`. On a concrete single-device array the compiled executable is\n"
        "    cached per (shape, dtype, s, axes, norm, device); under a trace this is plain `jnp.fft.{0}`.\n\n"
        "    Example:\n"
        "      >>> import jax.numpy as jnp, jbackends as jb\n"
        f"      >>> jb.fft.{fn_name}(jnp.ones((4, 4))).ndim\n"
        "      2\n"
    ).format(fn_name)
    return f


fft = _one_axis("fft")
ifft = _one_axis("ifft")
rfft = _one_axis("rfft")
irfft = _one_axis("irfft")
hfft = _one_axis("hfft")
ihfft = _one_axis("ihfft")
fft2 = _multi_axis("fft2", (-2, -1))
ifft2 = _multi_axis("ifft2", (-2, -1))
rfft2 = _multi_axis("rfft2", (-2, -1))
irfft2 = _multi_axis("irfft2", (-2, -1))
fftn = _multi_axis("fftn", None)
ifftn = _multi_axis("ifftn", None)
rfftn = _multi_axis("rfftn", None)
irfftn = _multi_axis("irfftn", None)

__all__ = [
    "cufft_plan_cache",
    "fft",
    "fft2",
    "fftn",
    "hfft",
    "ifft",
    "ifft2",
    "ifftn",
    "ihfft",
    "irfft",
    "irfft2",
    "irfftn",
    "rfft",
    "rfft2",
    "rfftn",
]
