"""Built-in ops. Importing this package registers them."""

from pegainfer.ir.ops import (attention, basic, latent_attention, linear_attention, moe, norm, quantize,  # noqa: F401
                              sampling)
