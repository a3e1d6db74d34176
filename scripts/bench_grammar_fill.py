"""The host's cost of a step's grammar masks: runtime/device_sampling.py device_masks over ROWS matchers of the
structured sweep's JSON schema (scripts/gpu/structured_sweep.py), each inside its "name" string after a run of one
word (where a random model's greedy output sits), median of a few hundred steps. `--padded` compiles over the
model's whole vocabulary, as before tokenizer_ids, for comparison.

    python3 scripts/gpu/random_checkpoint.py qwen3-4b /tmp/qwen3-4b-bpe --tokenizer bpe --config-only
    python3 scripts/bench_grammar_fill.py /tmp/qwen3-4b-bpe [--rows 31] [--padded]
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from structured_sweep import SCHEMA  # noqa: E402

from pegainfer.runtime.device_sampling import device_masks  # noqa: E402
from pegainfer.runtime.tokenizer import load_tokenizer  # noqa: E402
from pegainfer.server import structured  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a folder with config.json and the tokenizer's files")
    parser.add_argument("--rows", type=int, default=31)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--padded", action="store_true",
                        help="grammars over the model's vocabulary, not the tokenizer's")
    args = parser.parse_args()
    config = json.loads((args.checkpoint / "config.json").read_text())
    vocab = config.get("text_config", config)["vocab_size"]
    tokenizer = load_tokenizer(args.checkpoint)
    if args.padded:
        structured.tokenizer_ids = lambda tokenizer, stops, vocab_size: vocab_size
    grammars = structured.Grammars(tokenizer, vocab)
    make = grammars.constraint_factory(structured.GrammarSpec("json", json.dumps(SCHEMA), "response_format"))
    word = tokenizer.encode(" token", add_special_tokens=False)
    rows = [make() for _ in range(args.rows)]
    for row in rows:
        for token in tokenizer.encode('{"name": "', add_special_tokens=False) + word * 50:
            row.accept(token)
    times = []
    for _ in range(args.steps):
        began = time.perf_counter()
        masks = device_masks(rows, vocab)
        times.append(time.perf_counter() - began)
    assert len(masks) == args.rows
    print(f"{args.rows} rows, {grammars._tokens} of {vocab} ids: {1e3 * np.median(times):.3f} ms a step "
          f"(p90 {1e3 * np.percentile(times, 90):.3f})")


if __name__ == "__main__":
    main()
