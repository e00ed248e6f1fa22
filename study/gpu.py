"""The one GPU command: what a CPU cannot measure, PPO, live DPO and cached DPO side by side.

    python -m study.gpu            # one CUDA GPU, a few minutes: the table, and out/gpu/gpu.json
    python -m study.gpu --steps 5  # fewer timed steps

A GPT-2-124M-sized π_ref (12 layers, 768 wide, 12 heads; with the task's small vocabulary that is
85M parameters, nearly all in the blocks), untrained (time and memory do not depend on what the
weights know), on a 512-token block: the task's 64 tokens are too few to occupy a GPU, so each
prompt is preceded by other texts of the task, truncated to fill the block. The real loops run it,
ppo.main and dpo.main (--ref live, and the cache after precompute.main), under bf16 autocast with
--compile, and the table reads their own metrics.jsonl: the median step after the first (which
compiles, logged as time/compile), tokens/s, utilisation against the GPU's measured bf16 matmul
peak (the loops' mfu), and torch.cuda.max_memory_allocated over each run; beside them what bf16
must keep close at step 1 (DPO's loss ln 2 and accuracy 0; the gap between the log-probs of PPO's
bf16 rollout copy and its trainer). The table also replaces the section "gpu" of --results
(RESULTS.md). On a CPU it says it needs CUDA and exits with status 1.
"""
import gc
import json
import math
import os
import random
import shutil
import statistics
import time
from dataclasses import dataclass

import torch

import data
import dpo
import ppo
import precompute
import task
from checkpoint import atomic_write_json
from model import GPT, GPTConfig, save_model
from plumbing import check, fmt_duration, parse_config
from study.costs import table
from study.results import flags, write_section


@dataclass
class Config:
    out_dir: str = "out/gpu"  # task, models, caches and each loop's folder; gpu.json
    n_layer: int = 12  # GPT-2 124M's depth
    n_head: int = 12  # and heads
    n_embd: int = 768  # and width
    block: int = 512  # tokens per sequence: a long context before each prompt fills it
    pairs: int = 1024  # train pairs (DPO and the precompute); 64 more for val
    steps: int = 10  # timed DPO steps and (halved) PPO iterations, after the compiling one
    batch_size: int = 64  # DPO pairs and PPO rollouts per step, as the loops' defaults
    micro_batch_size: int = 32  # per forward: one GPU holds it, no accumulation
    compile: bool = True  # torch.compile the trained modules, as a GPU run should
    results: str = "RESULTS.md"  # its section "gpu" gets the table ("": none)


def long_prompts(rows, texts, rng):
    """Each prompt preceded by 48 random texts of the task as context: longer than any block here,
    so the loops' truncation (BOS and the prompt's last tokens) fills the block every time."""
    return [{**r, "prompt": " ".join(rng.sample(texts, 48) + [r["prompt"]])} for r in rows]


def write_jsonl(path, rows):
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    os.replace(path + ".tmp", path)


def run(name, main, out_dir, device):
    """One loop, its peak memory alone: the last run's tensors collected and the allocator's cache
    emptied before the counter is reset. Returns the table row from its metrics.jsonl."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    main()
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f]
    first, timed = steps[0], [s for s in steps[1:] if "tokens_per_sec" in s]
    med = lambda k: statistics.median(s[k] for s in timed)  # noqa: E731
    ms = "time/iteration" if name == "PPO" else "time/step"
    step1 = (f"loss {first['loss']:.5f} (ln 2 {first['loss'] - math.log(2):+.1e}), accuracy "
             f"{first['rewards/accuracies']:.3f}" if "loss" in first else
             f"bf16 rollout copy vs trainer: {first['logprob_gap']:.1e} nats per token")
    return dict(job=name, ms=med(ms), tokens_per_sec=med("tokens_per_sec"), mfu=med("mfu"),
                compile_s=first.get("time/compile", 0) / 1000, steps=len(timed),
                peak_bytes=torch.cuda.max_memory_allocated(device), step1=step1)


def main(cfg):
    check(torch.cuda.is_available(), "gpu.py needs a CUDA GPU (torch.cuda.is_available() is "
          "False): nothing measured. The CPU's numbers are study.compare's.")
    device, o, t0 = torch.device("cuda"), cfg.out_dir, time.time()
    t = lambda f: os.path.join(o, "task", f)  # noqa: E731
    if not os.path.exists(t("pairs_train.jsonl")):
        task.build_task(os.path.join(o, "task"))
    tok = data.load_tokenizer(t("tokenizer.json"))
    rng, texts = random.Random(0), data.read_texts(t("sft_train.txt"))
    pairs = long_prompts(data.read_pairs(t("pairs_train.jsonl"))[:cfg.pairs + 64], texts, rng)
    write_jsonl(t("long_train.jsonl"), pairs[:cfg.pairs])
    write_jsonl(t("long_val.jsonl"), pairs[cfg.pairs:])
    write_jsonl(t("long_prompts.jsonl"), long_prompts(
        [{"prompt": p} for p in data.read_prompts(t("prompts_train.jsonl"))[:1024]], texts, rng))
    # π_ref and r_φ: GPT-2 124M's shape, GPT-2's init (seeded), on the CPU then saved
    torch.manual_seed(0)
    size = dict(block_size=cfg.block, vocab_size=tok.vocab_size, n_layer=cfg.n_layer,
                n_head=cfg.n_head, n_embd=cfg.n_embd)
    ref, rm = f"{o}/sft/model.safetensors", f"{o}/reward/model.safetensors"
    for path, head in ((rm, "scalar"), (ref, "lm")):
        m = GPT(GPTConfig(**size, head=head))
        save_model(m, path, {"stage": "gpu.py: GPT-2 init, untrained"})
    shutil.copyfile(t("tokenizer.json"), f"{o}/sft/tokenizer.json")  # π_ref's folder holds it
    print(f"π_ref: {sum(p.numel() for p in m.parameters()) / 1e6:.1f}M parameters, block "
          f"{cfg.block} | {torch.cuda.get_device_name(device)} | bf16 autocast | compile "
          f"{cfg.compile}")

    n, B, mb = cfg.steps, cfg.batch_size, cfg.micro_batch_size
    pc = precompute.Config(out_dir=f"{o}/ref_logps", ref_model=ref, max_len=cfg.block,
                           train_pairs=t("long_train.jsonl"), val_pairs=t("long_val.jsonl"),
                           micro_batch_size=mb)  # training's micro-batch: the same shapes
    precompute.main(pc)
    dc = dict(ref_model=ref, train_pairs=pc.train_pairs, val_pairs=pc.val_pairs,
              test_prompts=t("prompts_test.jsonl"), ref_logps=pc.out_dir, max_len=cfg.block,
              batch_size=B, micro_batch_size=mb, steps=n + 2, stop_after=n + 1,
              eval_every=10 ** 6, ckpt_every=10 ** 6, compile=cfg.compile, resume=False)
    iters = max(n // 2, 2)
    pp = ppo.Config(out_dir=f"{o}/ppo", sft=ref, reward_model=rm, prompts=t("long_prompts.jsonl"),
                    test_prompts=t("prompts_test.jsonl"), rollout_batch=B, mini_batch=B // 2,
                    micro_batch_size=min(mb, B // 2), max_prompt_len=cfg.block - 64,
                    iterations=iters + 2, stop_after=iters + 1, ckpt_every=10 ** 6,
                    compile=cfg.compile, resume=False)
    rows = [run("PPO", lambda: ppo.main(pp), pp.out_dir, device)]
    for name, ref_mode in (("DPO, live π_ref", "live"), ("DPO, cached π_ref", "cache")):
        dcfg = dpo.Config(out_dir=f"{o}/dpo_{ref_mode}", ref=ref_mode, **dc)
        rows.append(run(name, lambda: dpo.main(dcfg), dcfg.out_dir, device))

    print(f"\n{'job':<18} {'ms/step':>8} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9} "
          f"{'compile':>8}   step-1 check (bf16)")
    for r in rows:
        print(f"{r['job']:<18} {r['ms']:>8.1f} {r['tokens_per_sec']:>10,.0f} {r['mfu']:>6.1%} "
              f"{r['peak_bytes'] / 2**30:>9.2f} {fmt_duration(r['compile_s']):>8}   {r['step1']}")
    note = (f"(medians over {rows[1]['steps']} DPO steps of {B} pairs and {rows[0]['steps']} PPO "
            f"iterations of {B} rollouts, after the first, which compiles; MFU against the "
            "measured bf16 matmul peak; peak: torch.cuda.max_memory_allocated over each whole run)")
    print(note)
    atomic_write_json(os.path.join(o, "gpu.json"), {"config": vars(cfg), "jobs": rows})
    md = table(["job", "ms/step", "tokens/s", "MFU", "peak GiB", "compile", "step-1 check (bf16)"],
               [[r["job"], f"{r['ms']:.1f}", f"{r['tokens_per_sec']:,.0f}", f"{r['mfu']:.1%}",
                 f"{r['peak_bytes'] / 2**30:.2f}", fmt_duration(r["compile_s"]), r["step1"]]
                for r in rows])
    about = (f"π_ref {cfg.n_layer} layers × {cfg.n_embd} wide, block {cfg.block}, bf16 autocast, "
             f"compile {cfg.compile}. {note[1:-1]}.")
    if write_section(cfg.results, "gpu", f"{md}\n\n{about}",
                     " ".join(["python -m study.gpu"] + flags(cfg)), time.time() - t0, device):
        print(f"wrote the section gpu of {cfg.results}")


if __name__ == "__main__":
    main(parse_config(Config, doc=__doc__))
