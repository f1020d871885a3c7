"""`jb.fft`: `jnp.fft` functions through the compiled-FFT cache `jb.cuda.cufft_plan_cache`.

Example:
  >>> import jax.numpy as jnp, jbackends as jb
  >>> jb.fft.rfft(jnp.ones(8)).shape
  (5,)
"""

from jbackends._src.fft import fft as fft
from jbackends._src.fft import fft2 as fft2
from jbackends._src.fft import fftn as fftn
from jbackends._src.fft import hfft as hfft
from jbackends._src.fft import ifft as ifft
from jbackends._src.fft import ifft2 as ifft2
from jbackends._src.fft import ifftn as ifftn
from jbackends._src.fft import ihfft as ihfft
from jbackends._src.fft import irfft as irfft
from jbackends._src.fft import irfft2 as irfft2
from jbackends._src.fft import irfftn as irfftn
from jbackends._src.fft import rfft as rfft
from jbackends._src.fft import rfft2 as rfft2
from jbackends._src.fft import rfftn as rfftn
