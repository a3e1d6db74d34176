"""Built-in ops. Importing this package registers them."""

from pegainfer.ir.ops import attention, basic, norm, sampling  # noqa: F401
