"""Which device a command runs on. The GPU runtime (issue 5) is not built yet, so every path runs on the CPU and
says why; asking for cuda explicitly fails with a clear message rather than silently using the CPU."""

from pegainfer.errors import PegainferError


def cuda_device_count() -> int:
    """Visible CUDA devices through the driver API; 0 when cuda-bindings or a driver is missing."""
    try:
        from cuda.bindings import driver
    except ImportError:
        return 0
    (status,) = driver.cuInit(0)
    if status != driver.CUresult.CUDA_SUCCESS:
        return 0
    status, count = driver.cuDeviceGetCount()
    return count if status == driver.CUresult.CUDA_SUCCESS else 0


def visible_sm() -> int | None:
    """The first visible GPU's compute capability as an SM number (90 for an H200), or None without one."""
    if not cuda_device_count():
        return None
    from cuda.bindings import driver

    attribute = driver.CUdevice_attribute
    _, major = driver.cuDeviceGetAttribute(attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 0)
    _, minor = driver.cuDeviceGetAttribute(attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, 0)
    return major * 10 + minor


def choose_device(requested: str | None) -> tuple[str, str]:
    """(device, why) for `--device` given or left out."""
    if requested == "cuda":
        raise PegainferError("--device cuda is not available yet: the GPU runtime is not built; use --device cpu")
    if requested == "cpu":
        return "cpu", "asked for"
    if cuda_device_count():
        return "cpu", "a CUDA device is present but the GPU runtime is not built yet"
    return "cpu", "no CUDA device found"
