"""Built-in ops. Importing this package registers them."""

from pegainfer.ir.ops import attention, basic, moe, norm, quantize, sampling  # noqa: F401
