"""Built-in ops. Importing this package registers them."""

from pegainfer.ir.ops import attention, basic, linear_attention, moe, norm, quantize, sampling  # noqa: F401
