"""The golden gate's metric on the CPU, to tell a kernel's error from a fixture's bf16 sensitivity: for each
checkpoint folder, mean and p99 |delta logprob| over the top 8, teacher-forced on Hugging Face bf16's greedy tokens,
between our bf16 reference engine, Hugging Face bf16 and Hugging Face float32 (torch on the CPU).

    python scripts/cpu_gate.py CHECKPOINT [CHECKPOINT ...]
"""
import sys
from pathlib import Path
import numpy as np, torch, transformers
from pegainfer.frontends.load import load_model
from pegainfer.runtime.batch import Chunk, Sequence
from pegainfer.runtime.reference_engine import ReferenceEngine

def teacher_forced(engine, prompts, conts):
    seqs = [Sequence(i, list(p)) for i, p in enumerate(prompts)]
    rows = [[] for _ in prompts]
    logits = engine.step([Chunk(s, len(s.token_ids)) for s in seqs])
    for step in range(len(conts[0]) + 1):
        for i in range(len(seqs)):
            rows[i].append(logits[i])
        if step == len(conts[0]):
            break
        for s, c in zip(seqs, conts):
            s.token_ids.append(c[step])
        logits = engine.step([Chunk(s, 1) for s in seqs])
    return [np.stack(r) for r in rows]

for folder in map(Path, sys.argv[1:]):
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    hf32 = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model = load_model(folder)
    engine = ReferenceEngine(model, max_tokens=4096)
    rng = np.random.default_rng(0)
    vocab = model.spec.config.vocab_size
    prompts = [rng.integers(0, vocab, n).tolist() for n in (5, 17, 1, 33)]
    conts, hf_rows, hf32_rows = [], [], []
    with torch.no_grad():
        for p in prompts:
            t = list(p)
            for _ in range(16):
                t.append(int(hf(torch.tensor([t])).logits[0, -1].argmax()))
            hf_rows.append(hf(torch.tensor([t])).logits[0].float().numpy()[len(p) - 1:])
            hf32_rows.append(hf32(torch.tensor([t])).logits[0].float().numpy()[len(p) - 1:])
            conts.append(t[len(p):])
    ours = teacher_forced(engine, prompts, conts)
    def metric(a_rows, b_rows):
        d = []
        for a, b in zip(a_rows, b_rows):
            la, lb = (torch.log_softmax(torch.from_numpy(x.astype(np.float64)), -1).numpy() for x in (a, b))
            for x, y in zip(la, lb):
                top = np.argsort(-x)[:8]; d += list(np.abs(y[top] - x[top]))
        return np.mean(d), np.percentile(d, 99)
    print(folder.name, "ours-bf16 vs hf-bf16 %.3f p99 %.3f" % metric(hf_rows, ours),
          "| hf-f32 vs hf-bf16 %.3f p99 %.3f" % metric(hf_rows, hf32_rows),
          "| ours-bf16 vs hf-f32 %.3f p99 %.3f" % metric(hf32_rows, ours), flush=True)
