"""A full-size random checkpoint folder in seconds, for the serving sweeps on the GPU machine (scripts/gpu/serve.sh):
an embedded config (or a config.json) as it is, the tokenizer files of `make-checkpoint` (one word per id, or
byte-level BPE for grammars that need punctuation), and model.safetensors holding `pegainfer bench`'s random weights
(runtime/bench.py random_weights: the values `bench decode` times), written straight from NumPy. `make-checkpoint`
builds the model in transformers first (77 s for Qwen3-4B on the H200; DeepSeek-V2-Lite would need 63 GB of float32):
speed does not depend on the values, so the sweeps use this.

The parsed config, and so the cubin manifest's model id (backends/cache.py model_id), is the embedded one's: the
eos / bos ids written for the tokenizer are not part of it, so `pegainfer compile NAME` here covers the folder there.
A multimodal wrapper (Qwen3.5) keeps its config.json and gets its text stack under model.language_model.*.

    python3 scripts/gpu/random_checkpoint.py qwen3.5-4b /tmp/qwen3.5-4b-random [--tokenizer bpe] [--config-only]
"""

import argparse
import json
import sys
import time
from math import prod
from pathlib import Path

import numpy as np

from pegainfer.fixtures.checkpoint import CHAT_TEMPLATE, SPECIAL_TOKENS, _train_tokenizer, _word_tokenizer
from pegainfer.frontends.load import load_spec, resolve_config_path
from pegainfer.runtime.bench import random_weights

SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float8_e4m3fn": "F8_E4M3",
                      "int32": "I32", "int64": "I64", "uint8": "U8"}


def write_config(config_path: Path, out: Path, tokenizer_kind: str) -> None:
    raw = json.loads(config_path.read_text())
    text = raw.get("text_config", raw)
    vocab_size = text["vocab_size"]
    tokenizer = (_train_tokenizer if tokenizer_kind == "bpe" else _word_tokenizer)(vocab_size)
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    special = dict(eos_token_id=ids["<|im_end|>"], bos_token_id=ids["<|endoftext|>"], pad_token_id=ids["<|endoftext|>"])
    raw.update(special)
    if text is not raw:
        text.update(special)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "bos_token": None, "model_max_length": text.get("max_position_embeddings", 2048)},
        indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "pad_token_id": ids["<|endoftext|>"],
        "bos_token_id": ids["<|endoftext|>"]}, indent=2) + "\n")


def write_weights(out: Path) -> int:
    """model.safetensors of every tensor the graph reads, by the checkpoint's names; returns its bytes."""
    spec = load_spec(out / "config.json", device="cuda")
    weights = random_weights(spec)
    if spec.text_stack:  # the wrapper's names (frontends/text_stack.py PREFIXES, as transformers 5 writes them)
        weights = {("model.language_model." + n[len("model."):]) if n.startswith("model.") else n: w
                   for n, w in weights.items()}
    header, offset = {}, 0
    for name, array in weights.items():
        nbytes = prod(array.shape) * array.dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[array.dtype.name], "shape": list(array.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(out / "model.safetensors", "wb") as handle:
        handle.write(len(blob).to_bytes(8, "little"))
        handle.write(blob)
        for array in weights.values():
            handle.write(np.ascontiguousarray(array).view(np.uint8).reshape(-1).data)
    return offset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="an embedded config (qwen3-4b, qwen3.5-4b, deepseek-v2-lite) or a config.json")
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokenizer", choices=["words", "bpe"], default="words")
    parser.add_argument("--config-only", action="store_true", help="config and tokenizer files, no weights")
    args = parser.parse_args()
    began = time.perf_counter()
    write_config(resolve_config_path(args.config), args.out, args.tokenizer)
    size = 0 if args.config_only else write_weights(args.out)
    print(f"random_checkpoint: {args.config} -> {args.out}, {size / 1e9:.2f} GB of weights in "
          f"{time.perf_counter() - began:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
