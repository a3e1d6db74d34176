"""Built-in ops. Importing this package registers them."""

from pegainfer.ir.ops import (attention, basic, collective, latent_attention, linear_attention, lora, moe,  # noqa: F401
                              norm, quantize, sampling)
