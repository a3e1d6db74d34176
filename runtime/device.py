"""Which device a command runs on: cuda when a GPU is visible, else cpu, saying why."""

from pegainfer.errors import PegainferError


def cuda_device_count() -> int:
    """Visible CUDA devices through the driver API; 0 when cuda-bindings or a driver is missing."""
    try:
        from cuda.bindings import driver
        (status,) = driver.cuInit(0)
    except (ImportError, RuntimeError):  # no cuda-bindings, or no libcuda to load
        return 0
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
    if requested == "cpu":
        return "cpu", "asked for"
    if requested == "cuda":
        if not cuda_device_count():
            raise PegainferError("--device cuda: no CUDA device is visible (and cuda-bindings must be installed)")
        return "cuda", "asked for"
    if cuda_device_count():
        return "cuda", "a CUDA device is visible"
    return "cpu", "no CUDA device found"
