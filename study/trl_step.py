"""TRL's DPOTrainer step on the built-in task, for study.packing to time beside dpo.py's: run by a
Python that has trl (never a dependency of this project: pip install trl in a venv of its own).

    /path/to/venv/bin/python -m study.trl_step HF_DIR PAIRS.jsonl OUT.json STEPS [--padding_free]

HF_DIR: π_ref exported by hf.export_gpt2 (transformers loads it as it is). The step is dpo.py's
defaults: 64 pairs in 2 micro-batches of 32, max_length 64, beta 0.5, lr 1e-3, the reference
log-probs precomputed (precompute_ref_log_probs, as dpo.py's cache), fp32 on the CPU. Writes
OUT.json: the trl version, whether padding_free was kept, each step's wall time (ms, between the
Trainer's on_step_begin and on_step_end: forwards, backwards, the optimizer step), and the
positions and real tokens of the micro-batches its collator built.
"""
import json
import sys
import time

import torch
import trl
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback


class StepTimes(TrainerCallback):
    def __init__(self):
        self.ms = []

    def on_step_begin(self, args, state, control, **kw):
        self.t = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self.ms.append(1000 * (time.perf_counter() - self.t))


def main(hf_dir, pairs, out, steps, padding_free=False):
    steps = int(steps)
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="sdpa")
    rows = load_dataset("json", data_files=pairs, split="train").select(range(64 * steps))
    args = trl.DPOConfig(output_dir=f"{out}.d", per_device_train_batch_size=32,
                         gradient_accumulation_steps=2, max_steps=steps, learning_rate=1e-3,
                         beta=0.5, max_length=64, precompute_ref_log_probs=True,
                         precompute_ref_batch_size=64, padding_free=padding_free, use_cpu=True,
                         report_to=[], save_strategy="no", logging_steps=10 ** 6,
                         dataloader_num_workers=0, seed=0)
    times = StepTimes()
    trainer = trl.DPOTrainer(model=model, args=args, train_dataset=rows, processing_class=tok,
                             callbacks=[times])
    count = {"positions": 0, "tokens": 0}
    collate = trainer.data_collator

    def counted(examples):  # what each micro-batch's forward runs over
        b = collate(examples)
        if "ref_chosen_logps" in b:  # the training batches, not the precompute's
            count["positions"] += b["input_ids"].numel()
            count["tokens"] += int(b["attention_mask"].sum())
        return b

    trainer.data_collator = counted
    trainer.train()
    with open(out, "w") as f:
        json.dump({"trl": trl.__version__, "padding_free": bool(trainer.padding_free),
                   "step_ms": times.ms, **count}, f)


if __name__ == "__main__":
    a = [x for x in sys.argv[1:] if x != "--padding_free"]
    main(*a, padding_free="--padding_free" in sys.argv)
