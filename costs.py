"""What each job costs, measured side by side at π_ref's size and extrapolated to 7B: the models
each training job holds and their bytes, the FLOPs of each phase, the wall time of the real loops
(in interleaved rounds: a busy machine slows every job alike, so the ratios hold), and the one-time
precompute with its payback. The analytic functions are checked here against the tensors' bytes and
torch's FLOP counter, then evaluated for a Llama-2-7B-sized GPT on 8 GPUs.

    python compare.py --no-frontier      # runs these tables alone (compare.py runs them after the
                                         # frontier); they land in out/compare/costs.{md,json}
"""
import copy
import gc
import json
import os
import statistics
import time
from dataclasses import asdict, replace

import torch

import data
import dpo
import ppo
import precompute
import reward
from model import GPTConfig, count_flops, estimate_flops, generate, load_model

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
            if cuda:  # the previous job's tensors freed and its cached blocks returned first
                gc.collect()
                torch.cuda.empty_cache()
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


