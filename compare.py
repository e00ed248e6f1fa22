"""PPO and DPO side by side: what leaves the cluster when DPO replaces PPO, in measured numbers.

    python compare.py                          # the frontier sweep, then the costs (~10 min on 2 CPU cores)
    torchrun --nproc_per_node=8 compare.py     # the same, every run on 8 ranks (plain DDP, as the stages)
    python compare.py --betas 0.01,0.03,0.1,0.3,1,3 --kl_coefs 0.005,0.02,0.05,0.2,0.5 --dpo_steps 300
    python compare.py --no-costs               # the frontier only (--no-frontier: the costs only)
    python compare.py --help                   # every flag

1. The frontier (Figure 2 of Rafailov et al. 2023): DPO at several β, PPO at several KL coefficients with r_φ
   as its reward and, as the paper's PPO-GT, with the hidden true reward; all from the same π_ref, pairs and
   prompts, each run by dpo.main / ppo.main in its own folder out/compare/<run>/ and scored by the evaluation
   both share (evaluate.evaluate_policy): true reward, KL(π‖π_ref), win rate against π_ref. A run whose
   eval.json exists with the same config and inputs is skipped, so an interrupted sweep resumes.
   Writes frontier.csv, frontier.md (+ frontier.png if matplotlib is installed).
2. The costs at π_ref's size: the models each job holds and their bytes, the FLOPs of each phase, the wall
   time of the real loops (in interleaved rounds: a busy machine slows every job alike, so the ratios hold),
   the one-time precompute and its payback; then the same analytic functions, checked here against the
   tensors' bytes and torch's FLOP counter, for a Llama-2-7B-sized GPT on 8 GPUs. Writes costs.md and
   costs.json; summary.md collects both under the command that made them.
Missing earlier stages (task, sft, reward model, reference cache) are built once with their defaults.
"""
import copy
import csv
import json
import os
import shlex
import statistics
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch

import data
import dpo
import ppo
import precompute
import reward
import sft
from evaluate import evaluate_policy
from model import GPTConfig, count_flops, estimate_flops, generate, load_model
from plumbing import (atomic_write_json, barrier, check, checkpoint_state, fmt_duration, init_distributed, main_decides,
                      parse_config, require_stage, teardown)


@dataclass
class Config:
    out_dir: str = "out/compare"  # tables, plot, and one folder per run of the sweep
    task: str = "out/task"  # pairs_{train,val}.jsonl, prompts_{train,eval}.jsonl; built if missing
    sft: str = "out/sft/model.safetensors"  # π_ref, shared by every run; built by sft.py if missing
    reward_model: str = "out/reward/model.safetensors"  # r_φ for PPO; built by reward.py if missing
    ref_logps: str = "out/ref_logps"  # DPO's cache of log π_ref; built by precompute.py if missing
    betas: str = "0.03,0.1,0.3,1,3"  # DPO runs: one per β, comma-separated
    kl_coefs: str = "0.01,0.03,0.1,0.3,1"  # PPO runs with r_φ: one per KL coefficient
    true_kl_coefs: str = "0.01,0.3"  # PPO-GT runs (--reward true): one per KL coefficient ("" = none)
    dpo_steps: int = dpo.Config.steps  # optimizer steps of each DPO run
    ppo_iterations: int = ppo.Config.iterations  # iterations of each PPO run
    eval_k: int = dpo.Config.eval_k  # completions per held-out prompt, every run and π_ref alike
    frontier: bool = True  # train the sweep, write frontier.*
    costs: bool = True  # measure the costs, write costs.*
    rounds: int = 3  # interleaved timing rounds, each: PPO, DPO live, DPO cached, precompute
    time_steps: int = 4  # iterations (PPO) or steps (DPO) per timed run; the first warms up, not counted


# -----------------------------------------------------------------------------
# The analytic costs. Checked against the tensors' nbytes and torch's FlopCounterMode at π_ref's size by
# every run (and the tests); the 7B table is the same functions at 7B.


def n_params(c):
    """(parameters, parameter tensors) of model.GPT(c); the tied lm_head is wte, counted once."""
    C, b = c.n_embd, c.bias
    block = 12 * C * C + 2 * C + (11 * C if b else 0)  # 4 matrices, 2 LayerNorm gains, 9C + 2C biases
    P = (c.vocab_size + c.block_size) * C + c.n_layer * block + C * (2 if b else 1)
    n = 2 + c.n_layer * (12 if b else 6) + (2 if b else 1)
    return (P + C + 1, n + 2) if c.head == "scalar" else (P, n)  # the scalar head: Linear(C, 1) with bias


def state_bytes(c, trainable, w=4, world=1, shard="ddp"):
    """Bytes one resident GPT holds on one rank: weights (w bytes each: 4 fp32, 2 bf16), and if it trains
    with AdamW, grads (w bytes), m and v (fp32), torch's 4-byte step count per tensor, and an fp32 master
    copy when w < 4 (mixed precision: ZeRO's 2 + 2 + 12 bytes per parameter, Rajbhandari et al. 2020).
    shard: "ddp" every rank holds it all; "zero1" the optimizer state is split over `world` ranks;
    "fsdp" weights, grads and optimizer state are all split (ZeRO-3)."""
    P, n = n_params(c)
    s = {"weights": w * P, "grads": w * P if trainable else 0,
         "optimizer": 8 * P + 4 * n + (4 * P if w < 4 else 0) if trainable else 0}
    split = {"ddp": (), "zero1": ("optimizer",), "fsdp": ("weights", "grads", "optimizer")}[shard]
    s = {k: v / world if k in split else v for k, v in s.items()}
    return {**s, "total": sum(s.values())}


def generate_flops(c, B, P, N):
    """model.generate writing N columns after a P-token prompt: a prefill forward over (B, P), then N - 1
    one-token forwards (the last sampled token is never fed back), the one at column S attending to S keys."""
    attn = lambda T, S: 4 * B * T * S * c.n_embd * c.n_layer  # noqa: E731  q·kᵀ and att·v, all heads
    return estimate_flops(c, B, P) + sum(estimate_flops(c, B, 1) - attn(1, 1) + attn(1, S) for S in range(P + 1, P + N))


def iteration_flops(c, job, B, T, P=0, epochs=4):
    """FLOPs of one iteration of `job` by phase, as the loops run it; c: the policy's GPTConfig (critic and
    r_φ are the same transformer with a one-unit head).
      dpo_cache, dpo_live: B pairs, (2B, T) rows [chosen; rejected]: the policy's forward and backward, and
          (live) π_ref's forward; the cache's reference is a lookup
      ppo: B rollouts of T columns, P of them prompt: the rollout engine samples them (KV cache), r_φ scores,
          policy (old log-probs), π_ref and critic run forward, `epochs` passes of forward + backward update."""
    f, s = estimate_flops, replace(c, head="scalar")
    if job == "ppo":
        return {"rollout": generate_flops(c, B, P, T - P), "reward": f(s, B, T), "ref_critic": 2 * f(c, B, T) + f(s, B, T),
                "update": epochs * (f(c, B, T, backward=True) + f(s, B, T, backward=True))}
    return {"policy": f(c, 2 * B, T, backward=True), "reference": f(c, 2 * B, T) if job == "dpo_live" else 0}


JOBS = {  # what each training job holds: (model, head, trains)
    "ppo": [("policy", "lm", True), ("critic", "scalar", True), ("reference", "lm", False),
            ("reward model", "scalar", False), ("rollout copy", "lm", False)],
    "dpo_live": [("policy", "lm", True), ("reference", "lm", False)],
    "dpo_cache": [("policy", "lm", True)]}
LABEL = {"ppo": "PPO", "dpo_live": "DPO, live π_ref", "dpo_cache": "DPO, cached log π_ref", "precompute": "precompute (once)"}
# The 7B extrapolation: a GPT with Llama-2-7B's depth, width, heads and vocabulary (bias-free, tied
# embeddings: 6.58B parameters against Llama's 6.74B, whose SwiGLU MLP has 3x11008 columns to our 2x16384).
BIG = dict(n_layer=32, n_head=32, n_embd=4096, vocab_size=32000, seq_len=512, prompt_len=256, gpus=8,
           weight_bytes=2, pairs=60_000, batch_pairs=64, ppo_epochs=4)

# -----------------------------------------------------------------------------
# Measuring at π_ref's size

def measured_bytes(m, opt=None):
    """Bytes m's tensors hold: parameters (a tied one once), their grads, and opt's state for them."""
    ps = list(m.parameters())
    s = {"weights": sum(p.nbytes for p in ps), "grads": sum(p.grad.nbytes for p in ps if p.grad is not None),
         "optimizer": sum(t.nbytes for p in ps for t in (opt.state[p].values() if opt else ()) if torch.is_tensor(t))}
    return {**s, "total": sum(s.values())}


def measure_small(cfg, d, B=32):
    """One iteration's model work of each job at π_ref's size on real pairs and prompts, with the calls the
    loops make (model.generate, precompute.pair_logps, forward + backward, an AdamW step). Returns the
    GPTConfig, the FLOPs counted by phase, the shapes iteration_flops needs, and per model (the bytes its
    tensors hold, bytes per weight)."""
    tok = data.load_tokenizer(precompute.tokenizer_path(cfg.sft))
    frozen = lambda m: m.eval().requires_grad_(False)  # noqa: E731
    policy, ref = load_model(cfg.sft, d.device)[0].eval(), frozen(load_model(cfg.sft, d.device)[0])
    critic = reward.load_trunk(cfg.reward_model, "scalar", d.device)[0]
    rm = frozen(reward.load_trunk(cfg.reward_model, "scalar", d.device)[0])
    rollout = frozen(copy.deepcopy(policy).to(torch.bfloat16 if d.device.type == "cuda" else torch.float32))  # as ppo.py
    c = policy.config
    pairs, _ = data.tokenize_pairs(tok, data.read_pairs(f"{cfg.task}/pairs_train.jsonl")[:B], dpo.Config.max_len,
                                   dpo.Config.max_prompt_len)
    b = data.collate_pairs(pairs, tok.pad)
    x, y = b["input_ids"].to(d.device), b["targets"].to(d.device)  # (2B, T)
    _, f_policy = count_flops(lambda: precompute.pair_logps(policy, x, y).sum().backward())
    with torch.no_grad():
        _, f_ref = count_flops(lambda: precompute.pair_logps(ref, x, y))
        prompts = [data.encode_prompt(tok, p) for p in data.read_prompts(f"{cfg.task}/prompts_train.jsonl")[:B]]
        P, g = max(map(len, prompts)), torch.Generator(device=d.device).manual_seed(0)
        out, f_roll = count_flops(lambda: generate(rollout, prompts, c.block_size - P, tok.eos, tok.pad, generator=g))
        t, m = out["tokens"], out["mask"]  # (B, P + N)
        _, f_rm = count_flops(lambda: rm(t, mask=m))
        _, f_rc = count_flops(lambda: (policy(t, mask=m), ref(t, mask=m), critic(t, mask=m)))
    _, f_up = count_flops(lambda: [(policy(t, mask=m).sum() + critic(t, mask=m).sum()).backward()
                               for _ in range(ppo.Config.ppo_epochs)])
    opts = [torch.optim.AdamW(mod.parameters()) for mod in (policy, critic)]
    for o in opts:
        o.step()  # AdamW allocates m, v and the step counts on its first step
    flops = {"ppo": {"rollout": f_roll, "reward": f_rm, "ref_critic": f_rc, "update": f_up},
             "dpo_live": {"policy": f_policy, "reference": f_ref}, "dpo_cache": {"policy": f_policy, "reference": 0}}
    shapes = {"ppo": dict(B=B, T=t.shape[1], P=P, epochs=ppo.Config.ppo_epochs),
              "dpo_live": dict(B=B, T=x.shape[1]), "dpo_cache": dict(B=B, T=x.shape[1])}
    models = {"policy": (policy, opts[0]), "critic": (critic, opts[1]), "reference": (ref, None),
              "reward model": (rm, None), "rollout copy": (rollout, None)}
    return c, flops, shapes, {k: (measured_bytes(mod, o), next(mod.parameters()).element_size())
                              for k, (mod, o) in models.items()}


def timed_runs(cfg, d, say):
    """Wall time of the real loops at their default sizes, interleaved: each round runs a few PPO iterations,
    DPO steps with the live reference and with the cache (stopped before they evaluate), and the whole
    precompute. Per round and job: the median step (the first warms up, dropped), its phases and tokens/s
    from the stage's metrics.jsonl, and on CUDA the peak memory allocated."""
    root, n, t = os.path.join(cfg.out_dir, "timing"), cfg.time_steps, lambda f: os.path.join(cfg.task, f)
    dc = dict(ref_model=cfg.sft, train_pairs=t("pairs_train.jsonl"), val_pairs=t("pairs_val.jsonl"), resume=False,
              eval_prompts=t("prompts_eval.jsonl"), ref_logps=cfg.ref_logps, steps=n + 1, stop_after=n, eval_every=10 ** 6)
    jobs = {"ppo": lambda: ppo.main(ppo.Config(
                out_dir=f"{root}/ppo", sft=cfg.sft, reward_model=cfg.reward_model, prompts=t("prompts_train.jsonl"),
                eval_prompts=t("prompts_eval.jsonl"), iterations=n + 1, stop_after=n, resume=False)),
            "dpo_live": lambda: dpo.main(dpo.Config(out_dir=f"{root}/dpo_live", ref="live", **dc)),
            "dpo_cache": lambda: dpo.main(dpo.Config(out_dir=f"{root}/dpo_cache", ref="cache", **dc)),
            "precompute": lambda: precompute.main(precompute.Config(
                out_dir=f"{root}/ref_logps", ref_model=cfg.sft, train_pairs=t("pairs_train.jsonl"),
                val_pairs=t("pairs_val.jsonl")))}
    cuda, rounds = d.device.type == "cuda", []
    for r in range(cfg.rounds):
        rounds.append({})
        for name, run in jobs.items():
            say(f"[costs] timing round {r + 1}/{cfg.rounds}: {LABEL[name]}")
            if cuda:
                torch.cuda.reset_peak_memory_stats(d.device)
            t0 = time.perf_counter()
            run()
            row = rounds[-1][name] = {"ms": 1000 * (time.perf_counter() - t0), "phases": {}}
            if cuda:
                row["peak_bytes"] = torch.cuda.max_memory_allocated(d.device)
            if name != "precompute" and d.is_main:  # metrics.jsonl is rank 0's
                with open(f"{root}/{name}/metrics.jsonl") as f:
                    steps = [json.loads(line) for line in f][1:]
                med = {k: statistics.median(s[k] for s in steps) for k in steps[0] if k.startswith(("time/", "tokens_"))}
                whole = ("time/step", "time/iteration")  # dpo.py's and ppo.py's totals; other time/ keys are phases
                row["phases"] = {k[5:].removesuffix("_ms"): v for k, v in med.items() if k.startswith("time/") and k not in whole}
                row.update(ms=next((med[k] for k in whole if k in med), sum(row["phases"].values())),
                           tokens_per_sec=med["tokens_per_sec"])
    return rounds


def costs(cfg, d, say):
    """Everything at π_ref's size, analytic beside measured, and the 7B extrapolation: costs.json's dict."""
    say("[costs] counting the FLOPs and bytes of one iteration of each job at π_ref's size")
    c, flops, shapes, models = measure_small(cfg, d)
    n_pairs = sum(len(data.read_pairs(f"{cfg.task}/pairs_{s}.jsonl")) for s in ("train", "val"))
    rounds = timed_runs(cfg, d, say)
    if not d.is_main:
        return None
    res = {"model": asdict(c), "params": n_params(c)[0], "device": str(d.device), "world": d.world,
           "threads": torch.get_num_threads(), "n_pairs": n_pairs, "jobs": {}, "rounds": rounds}
    for job, held in JOBS.items():
        mods = {k: {"trainable": tr, "analytic": state_bytes(replace(c, head=h), tr, w=models[k][1]), "measured": models[k][0]}
                for k, h, tr in held}
        peak = [r[job]["peak_bytes"] for r in rounds if "peak_bytes" in r[job]]
        res["jobs"][job] = dict(models=mods, cache_bytes=8 * n_pairs if job == "dpo_cache" else 0,  # 2 fp32 a pair
                                flops_analytic=iteration_flops(c, job, **shapes[job]), flops_counted=flops[job],
                                tokens=shapes[job]["B"] * shapes[job]["T"] * (1 if job == "ppo" else 2),
                                peak_bytes=max(peak, default=None),
                                **{f"bytes_{k}": {s: sum(m[k][s] for m in mods.values()) for s in mods["policy"][k]}
                                   for k in ("analytic", "measured")})
    # wall time: medians over the rounds, of each job and of the ratios taken within each round
    med = lambda f: statistics.median(f(r) for r in rounds)  # noqa: E731
    for job in LABEL:
        res["jobs"].setdefault(job, {})["time"] = dict(
            ms=med(lambda r: r[job]["ms"]), per_dpo_cached=med(lambda r: r[job]["ms"] / r["dpo_cache"]["ms"]),
            tokens_per_sec=med(lambda r: r[job].get("tokens_per_sec", 0)),
            phases={k: statistics.median(r[job]["phases"][k] for r in rounds) for k in rounds[0][job]["phases"]})
    res["payback_steps"] = med(lambda r: r["precompute"]["ms"] / max(r["dpo_live"]["ms"] - r["dpo_cache"]["ms"], 1e-9))
    res["payback_steps_flops"] = n_pairs / dpo.Config.batch_size  # the live reference's forwards over one pass
    return {**res, "at_7b": at_7b()}


def at_7b(a=BIG):
    """The same analytic functions at a Llama-2-7B-sized GPT: bytes per GPU under DDP, ZeRO-1 and FSDP,
    FLOPs per token, and the steps after which the precompute has paid for itself."""
    big = GPTConfig(block_size=a["seq_len"], vocab_size=a["vocab_size"], n_layer=a["n_layer"], n_head=a["n_head"],
                    n_embd=a["n_embd"], bias=False)
    res = {"assumptions": a, "params": n_params(big)[0], "jobs": {}}
    for job, held in JOBS.items():
        fl = iteration_flops(big, job, 1, a["seq_len"], a["prompt_len"] if job == "ppo" else 0, a["ppo_epochs"])
        gpu = {sh: sum(state_bytes(replace(big, head=h), tr, a["weight_bytes"], a["gpus"], sh)["total"] for _, h, tr in held)
               for sh in ("ddp", "zero1", "fsdp")}
        res["jobs"][job] = {"flops_by_phase": fl, "bytes_per_gpu": gpu,
                            "flops_per_token": sum(fl.values()) / (a["seq_len"] * (1 if job == "ppo" else 2))}
    saved = iteration_flops(big, "dpo_live", a["batch_pairs"], a["seq_len"])["reference"]  # what the cache saves a step
    return {**res, "payback_steps": estimate_flops(big, 2 * a["pairs"], a["seq_len"]) / saved}


def table(head, rows):
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(map(str, r)) + " |"
                                                                                  for r in rows])


def size(b):
    return f"{b / 2**30:,.1f} GiB" if b >= 2**30 else f"{b / 2**20:,.2f} MiB"


def costs_markdown(res, cfg):
    ok = lambda good: " ✓" if good else " ✗"  # noqa: E731
    c, J, a, B = GPTConfig(**res["model"]), res["jobs"], res["at_7b"]["assumptions"], res["at_7b"]["jobs"]
    held, flop, wall = [], [], []
    for job in JOBS:
        r, an, me = J[job], J[job]["bytes_analytic"], J[job]["bytes_measured"]
        held.append([LABEL[job], ", ".join(f"{k} ({'trains' if m['trainable'] else 'frozen'})" for k, m in r["models"].items()),
                     *map(size, an.values()), size(me["total"]) + ok(me == an),
                     size(r["cache_bytes"]) if r["cache_bytes"] else "–",
                     size(r["peak_bytes"]) if r["peak_bytes"] else "not measured (CPU)"])
        fl, n, cnt = r["flops_analytic"], r["tokens"], r["flops_counted"]
        flop += [[LABEL[job], k, f"{v / 1e6:,.1f}", f"{cnt[k] / 1e6:,.1f}" + ok(v == cnt[k]), f"{v / n / 1e3:,.1f}"]
                 for k, v in fl.items()]
        tot = sum(fl.values())
        flop.append([f"**{LABEL[job]}**", "**total**", f"**{tot / 1e6:,.1f}**", "", f"**{tot / n / 1e3:,.1f}**"])
    per = {"ppo": (ppo.Config.rollout_batch, "rollouts"), "dpo_live": (dpo.Config.batch_size, "pairs"),
           "dpo_cache": (dpo.Config.batch_size, "pairs"), "precompute": (res["n_pairs"], "pairs (train + val)")}
    for job, (n, unit) in per.items():
        t = J[job]["time"]
        wall.append([LABEL[job], f"{t['ms']:,.0f}", f"{n} {unit}", f"{t['ms'] / n:.2f}",
                     f"{t['tokens_per_sec']:,.0f}" if t["tokens_per_sec"] else "–",
                     f"{t['per_dpo_cached']:.1f}×" if job != "precompute" else f"= {t['per_dpo_cached']:.0f} cached steps",
                     " · ".join(f"{k} {v:,.0f}" for k, v in t["phases"].items()) or "(the whole run)"])
    big = [[LABEL[job], len(JOBS[job]), *(size(r["bytes_per_gpu"][s]) for s in ("ddp", "zero1", "fsdp")),
            f"{r['flops_per_token'] / 1e9:.1f}", f"{r['flops_per_token'] / B['dpo_cache']['flops_per_token']:.1f}×"]
           for job, r in B.items()]
    return "\n".join([
        f"## Costs at π_ref's size: {c.n_layer} layers × {c.n_embd} wide, vocabulary {c.vocab_size}, block {c.block_size} "
        f"({res['params'] / 1e6:.2f}M parameters), {res['world']} × {res['device']}, {res['threads']} threads", "",
        "### What the training job holds (per rank; analytic, ✓ = the tensors' nbytes agree exactly)", "",
        table(["job", "models resident", "weights", "grads", "AdamW state", "total", "measured", "ref cache", "peak memory"],
              held), "",
        "Measured: the parameters' nbytes (a tied weight once), their grads after a backward, AdamW's state after a step. "
        "Peak memory: torch.cuda.max_memory_allocated over a timed run, on a GPU; the CPU keeps no allocator statistics, "
        "so there only the model state is known (activations come on top).", "",
        "### What a token costs (FLOPs of one iteration at real shapes; ✓ = torch's FlopCounterMode counts the same)", "",
        table(["job", "phase", "analytic MFLOP", "counted MFLOP", "kFLOP per token"], flop), "",
        "Per token: per position of the iteration's sequences, padding included (DPO's (2B, T) pair rows, PPO's (B, T) "
        "rollouts). PPO's rollout samples with the KV cache; its update is ppo_epochs passes through policy and critic.", "",
        f"### Wall time of the real loops (median of {cfg.rounds} interleaved rounds, {cfg.time_steps - 1} timed steps each)", "",
        table(["job", "ms per iteration", "examples", "ms per example", "tokens/s", "× DPO cached", "phases (ms)"], wall), "",
        f"The precompute pays for itself after {res['payback_steps']:.0f} DPO steps of saved reference forwards (measured); "
        f"by FLOPs after {res['payback_steps_flops']:.0f}, one pass over the {res['n_pairs']} pairs at "
        f"{dpo.Config.batch_size} a step.",
        "", f"## The same functions at 7B on {a['gpus']} GPUs", "",
        f"A GPT with Llama-2-7B's shape: {a['n_layer']} layers × {a['n_embd']} wide, {a['n_head']} heads, vocabulary "
        f"{a['vocab_size']}, no biases, tied embeddings ({res['at_7b']['params'] / 1e9:.2f}B parameters). Weights in bf16; a "
        f"trained model adds bf16 grads, an fp32 master copy and Adam's m and v (16 bytes per parameter); PPO's rollout copy "
        f"is bf16. Sequences of {a['seq_len']} tokens (PPO: {a['prompt_len']} prompt + {a['seq_len'] - a['prompt_len']} "
        f"response), {a['ppo_epochs']} PPO epochs, DPO batches of {a['batch_pairs']} pairs from {a['pairs']:,}. Model state "
        "only: activations, PPO's KV cache and communication buffers come on top.", "",
        table(["job", "models", "DDP per GPU", "ZeRO-1 per GPU", "FSDP per GPU", "GFLOP per token", "× DPO cached"], big), "",
        f"The precompute (one forward of π_ref over every pair) pays for itself after {res['at_7b']['payback_steps']:.0f} "
        f"steps: the reference forwards a live job runs in one epoch. Then a step costs "
        f"{B['dpo_cache']['flops_per_token'] / B['dpo_live']['flops_per_token']:.0%} of a live one's FLOPs, and π_ref's "
        f"{size(2 * res['at_7b']['params'])} of bf16 weights are off every GPU."])


# -----------------------------------------------------------------------------
# The frontier


def sweep(cfg):
    """The runs: (name, stage, its Config), all from the same π_ref, pairs and prompts."""
    t, o = (lambda f: os.path.join(cfg.task, f)), (lambda name: os.path.join(cfg.out_dir, name))
    floats = lambda s: [float(v) for v in s.split(",") if v.strip()]  # noqa: E731
    runs = [(f"dpo-beta{b:g}", dpo, dpo.Config(
        out_dir=o(f"dpo-beta{b:g}"), ref_model=cfg.sft, train_pairs=t("pairs_train.jsonl"), val_pairs=t("pairs_val.jsonl"),
        eval_prompts=t("prompts_eval.jsonl"), ref_logps=cfg.ref_logps, beta=b, steps=cfg.dpo_steps, eval_k=cfg.eval_k))
        for b in floats(cfg.betas)]
    for rw, coefs, tag in (("model", cfg.kl_coefs, "ppo"), ("true", cfg.true_kl_coefs, "ppo-true")):
        runs += [(f"{tag}-kl{k:g}", ppo, ppo.Config(
            out_dir=o(f"{tag}-kl{k:g}"), sft=cfg.sft, reward_model=cfg.reward_model, prompts=t("prompts_train.jsonl"),
            eval_prompts=t("prompts_eval.jsonl"), reward=rw, kl_coef=k, iterations=cfg.ppo_iterations, eval_k=cfg.eval_k))
            for k in floats(coefs)]
    return runs


def evaluate_reference(cfg, d):
    """π_ref against a second copy of itself through the same evaluation, with DPO's seed: the frontier's
    origin (KL 0; win rate 1/2 up to sampling error)."""
    tok = data.load_tokenizer(precompute.tokenizer_path(cfg.sft))
    ref, ref2 = load_model(cfg.sft, d.device)[0], load_model(cfg.sft, d.device)[0]
    res = evaluate_policy(ref, ref2, tok, data.read_prompts(os.path.join(cfg.task, "prompts_eval.jsonl")), d, k=cfg.eval_k)
    if d.is_main:
        atomic_write_json(os.path.join(cfg.out_dir, "ref", "eval.json"), res)


def frontier(cfg, d, say):
    """Train every run not already done; then, on rank 0, one row per run from its eval.json."""
    sha = {p: precompute.sha256(p) for p in (cfg.sft, cfg.reward_model)}
    todo = [("ref", None, {"k": cfg.eval_k, "prompts": os.path.join(cfg.task, "prompts_eval.jsonl")})] + sweep(cfg)
    t0, trained, spent = time.time(), 0, 0.0
    for i, (name, stage, c) in enumerate(todo):
        # run.json: what the run was made from (its config, π_ref's and r_φ's sha256) and whether it finished
        out, uses_rm = os.path.join(cfg.out_dir, name), stage is ppo and c.reward == "model"
        rec = {"stage": stage.__name__ if stage else "evaluate", "config": asdict(c) if stage else c,
               "sft_sha256": sha[cfg.sft], **({"reward_model_sha256": sha[cfg.reward_model]} if uses_rm else {})}
        saved = json.loads(Path(out, "run.json").read_text()) if os.path.exists(f"{out}/run.json") else {}
        if main_decides(saved.get("run") == rec and saved["finished"] and os.path.exists(f"{out}/eval.json"), d):
            say(f"[{i + 1}/{len(todo)}] {name}: eval.json exists with the same config and inputs: skipped")
            continue
        resume = main_decides(saved.get("run") == rec, d)  # this run, interrupted: resume; anything else: start over
        what = ("π_ref against itself" if stage is None else f"dpo.main, β {c.beta:g}, {c.steps} steps" if stage is dpo else
                f"ppo.main, {'r_φ' if uses_rm else 'the true reward'}, KL coef {c.kl_coef:g}, {c.iterations} iterations")
        say(f"[{i + 1}/{len(todo)}] {name}: {what}" + (" (resuming)" if resume and checkpoint_state(f"{out}/ckpt") else ""))
        if d.is_main:
            os.makedirs(out, exist_ok=True)
            atomic_write_json(f"{out}/run.json", {"run": rec, "finished": False})
        barrier(d)
        t1 = time.time()
        evaluate_reference(cfg, d) if stage is None else stage.main(replace(c, resume=resume))
        wall = time.time() - t1
        trained, spent = trained + (stage is not None), spent + wall * (stage is not None)
        if d.is_main:
            atomic_write_json(f"{out}/run.json", {"run": rec, "finished": True, "wall_s": wall})
        left = sum(1 for r in todo[i + 1:] if r[1] is not None)
        say(f"[{i + 1}/{len(todo)}] {name} done in {fmt_duration(wall)} | sweep {fmt_duration(time.time() - t0)} so far"
            + (f", about {fmt_duration(spent / trained * left)} to go" if left and trained else ""))
    rows = []
    for name, stage, c in todo if d.is_main else ():
        ev, run = (json.loads(Path(cfg.out_dir, name, f).read_text()) for f in ("eval.json", "run.json"))
        method = "π_ref" if stage is None else "DPO" if stage is dpo else "PPO" if c.reward == "model" else "PPO-GT"
        rows.append(dict(run=name, method=method, beta=c.beta if stage is dpo else "", kl_coef=c.kl_coef if stage is ppo else "",
                         kl=ev["kl"], true_reward=ev["true_reward"], win_rate=ev["win_rate"],
                         true_reward_se=ev["true_reward_std"] / ev["n_completions"] ** 0.5,  # standard error of the mean
                         ref_true_reward=ev["ref_true_reward"], n_completions=ev["n_completions"], wall_s=run.get("wall_s")))
    return rows


def write_frontier(rows, cfg):
    """frontier.csv, frontier.md and, if matplotlib is installed, frontier.png; returns the markdown."""
    with open(f"{cfg.out_dir}/frontier.csv.tmp", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    os.replace(f"{cfg.out_dir}/frontier.csv.tmp", f"{cfg.out_dir}/frontier.csv")
    md = table(["run", "method", "β / KL coef", "KL(π‖π_ref) nats", "true reward ± s.e.", "win rate vs π_ref", "wall time"],
               [[r["run"], r["method"], r["beta"] if r["method"] == "DPO" else r["kl_coef"], f"{r['kl']:.3f}",
                 f"{r['true_reward']:+.3f} ± {r['true_reward_se']:.3f}", f"{r['win_rate']:.3f}",
                 fmt_duration(r["wall_s"]) if r["wall_s"] is not None else "–"] for r in rows])
    md = (f"## The frontier: true reward against KL(π‖π_ref), as Figure 2 of the DPO paper\n\n{md}\n\nEach policy sampled "
          f"{cfg.eval_k} completions of every held-out prompt ({rows[0]['n_completions']} in all, temperature 1). KL: their "
          "mean Σ_t log π − log π_ref, with the training log-prob function; true reward: the task's hidden reward, mean ± "
          "standard error; win rate: against π_ref's completions of the same prompts, ties half. The π_ref row is π_ref "
          "against a second copy of itself. Wall time: training and evaluation of the run.")
    with open(f"{cfg.out_dir}/frontier.md", "w") as f:
        f.write(md + "\n")
    try:  # the plot is optional: nothing else needs matplotlib
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return md + "\n\n(no frontier.png: matplotlib is not installed)"
    fig, ax = plt.subplots(figsize=(6, 4))
    for method, marker in (("π_ref", "*"), ("DPO", "o"), ("PPO", "s"), ("PPO-GT", "^")):
        rs = sorted((r for r in rows if r["method"] == method), key=lambda r: r["kl"])
        if rs:  # a method's runs joined in order of KL: its frontier
            ax.errorbar([r["kl"] for r in rs], [r["true_reward"] for r in rs], yerr=[r["true_reward_se"] for r in rs],
                        fmt=marker + "-", capsize=2, label=method)
    ax.set(xlabel="KL(π‖π_ref), nats per completion", ylabel="true reward", title="true reward against KL, held-out prompts")
    ax.legend()
    fig.tight_layout()
    fig.savefig(f"{cfg.out_dir}/frontier.png", dpi=120)
    plt.close(fig)
    return md


def command(cfg):
    """compare.py with the flags that differ from the defaults: the command that reproduces the tables."""
    flag = lambda f, v: (f"--{'' if v else 'no-'}{f.name}" if isinstance(v, bool)  # noqa: E731
                         else f"--{f.name} {shlex.quote(str(v))}")
    return " ".join(["compare.py"] + [flag(f, getattr(cfg, f.name)) for f in fields(cfg) if getattr(cfg, f.name) != f.default])


def main(cfg):
    d = init_distributed()
    say = lambda *a: print(*a, flush=True) if d.is_main else None  # noqa: E731  rank 0 speaks
    check(cfg.time_steps >= 2, "--time_steps must be >= 2: the first step of a timed run warms up and is dropped")
    t0, t = time.time(), lambda f: os.path.join(cfg.task, f)
    # the earlier stages, shared by every run: built once, with their defaults, when missing
    for f in ("pairs_train.jsonl", "pairs_val.jsonl", "prompts_train.jsonl", "prompts_eval.jsonl"):
        require_stage(t(f), os.path.join(Config.task, f), lambda: sft.build_task(d), "python data.py", d, say)
    require_stage(cfg.sft, Config.sft, lambda: (sft.main(sft.Config()), barrier(d)), "python sft.py", d, say)
    require_stage(cfg.reward_model, Config.reward_model, lambda: (reward.main(reward.Config()), barrier(d)),
                  "python reward.py", d, say)
    pc = precompute.Config(out_dir=cfg.ref_logps, ref_model=cfg.sft, train_pairs=t("pairs_train.jsonl"),
                           val_pairs=t("pairs_val.jsonl"))
    for split in ("train", "val"):
        require_stage(f"{cfg.ref_logps}/{split}.safetensors", f"{Config.ref_logps}/{split}.safetensors",
                      lambda: precompute.main(pc), precompute.command(pc), d, say)
    os.makedirs(cfg.out_dir, exist_ok=True)
    if cfg.frontier:
        rows = frontier(cfg, d, say)
        if d.is_main:
            say(write_frontier(rows, cfg) + f"\nwrote {cfg.out_dir}/frontier.csv and frontier.md")
    if cfg.costs:
        res = costs(cfg, d, say)
        if d.is_main:
            atomic_write_json(f"{cfg.out_dir}/costs.json", res)
            with open(f"{cfg.out_dir}/costs.md", "w") as f:
                f.write(costs_markdown(res, cfg) + "\n")
            say(costs_markdown(res, cfg) + f"\nwrote {cfg.out_dir}/costs.md and costs.json")
    if d.is_main:
        parts = [Path(cfg.out_dir, n).read_text() for n in ("frontier.md", "costs.md") if os.path.exists(f"{cfg.out_dir}/{n}")]
        cmd = (f"torchrun --nproc_per_node={d.world} " if d.world > 1 else "python ") + command(cfg)
        with open(f"{cfg.out_dir}/summary.md", "w") as f:
            f.write(f"# PPO against DPO, measured\n\nProduced by `{cmd}` in {fmt_duration(time.time() - t0)} on "
                    f"{d.world} × {d.device} ({torch.get_num_threads()} threads per rank).\n\n" + "\n\n".join(parts))
        say(f"wrote {cfg.out_dir}/summary.md; compare.py took {fmt_duration(time.time() - t0)}")
    teardown(d)


if __name__ == "__main__":
    main(parse_config(Config, doc=__doc__))
