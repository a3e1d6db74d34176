"""A bf16 copy of an FP8 checkpoint, each FP8 weight times its scales as the format means it (by torch, apart from
pegainfer's dequantize op), for Hugging Face to run as the reference of the FP8 gate (scripts/gpu/fp8_check.py).
Usage: dequantized_copy.py FP8_FOLDER OUT_FOLDER"""

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def dequantized(stored: dict[str, torch.Tensor], block: list[int] | None) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in stored.items():
        if name.endswith(("_scale", "_scale_inv")):
            continue
        if tensor.dtype != torch.float8_e4m3fn:
            out[name] = tensor.to(torch.bfloat16)
            continue
        scale = stored[f"{name}_scale"] if f"{name}_scale" in stored else stored[f"{name}_scale_inv"]
        if block is not None and scale.shape != (tensor.shape[0], 1):
            scale = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
            scale = scale[: tensor.shape[0], : tensor.shape[1]]
        out[name] = (tensor.float() * scale.float()).to(torch.bfloat16)
    return out


def main(source: Path, target: Path) -> None:
    config = json.loads((source / "config.json").read_text())
    block = config.pop("quantization_config").get("weight_block_size")
    config["torch_dtype"] = "bfloat16"
    target.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.suffix != ".safetensors" and path.name != "config.json" and path.is_file():
            shutil.copy(path, target / path.name)
    (target / "config.json").write_text(json.dumps(config, indent=1))
    stored = {}
    for path in sorted(source.glob("*.safetensors")):
        stored |= load_file(path)
    save_file(dequantized(stored, block), target / "model.safetensors")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
