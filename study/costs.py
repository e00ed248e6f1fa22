"""What each job costs, measured side by side at π_ref's size and extrapolated to 7B: the models
each training job (PPO, GRPO, online DPO, iterative DPO, DPO with a live or a cached π_ref, SimPO
with none) holds and their bytes, the FLOPs of each phase (per padded position, per real
token, per example), the wall time and utilisation of the real loops (in interleaved rounds: a busy
machine slows every job alike, so the ratios hold), and the one-time precompute with its payback in
FLOPs and in time. The analytic functions are checked here against the tensors' bytes and torch's
FLOP counter, then evaluated for a Llama-2-7B-sized GPT on 8 GPUs.

    python -m study.compare --no-frontier  # runs these tables alone (study.compare runs them after
                                           # the frontier); they land in out/compare/costs.{md,json}
    torchrun --nproc_per_node=2 -m study.costs  # per-rank state under DDP and --fsdp, measured;
                                           # also the section "fsdp" of RESULTS.md
"""
import copy
import gc
import glob
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch.distributed.tensor import DTensor

import data
import dpo
import grpo
import iterative_dpo
import online_dpo
import ppo
import precompute
import reward
from checkpoint import tokenizer_beside
from meter import count_flops, estimate_flops, generate_flops
from model import (IGNORE, GPT, GPTConfig, generate, load_model, pair_logps, score_at_last,
                   sequence_logprobs)
from plumbing import adamw, all_reduce_sum, check, init_distributed, parse_config, teardown, wrap
from study.results import flags, launcher, write_section

# -----------------------------------------------------------------------------
# The analytic costs. Checked against the tensors' nbytes and torch's FlopCounterMode at π_ref's
# size by every run (and the tests); the 7B table is the same functions at 7B.


def n_params(c):
    """(parameters, parameter tensors) of model.GPT(c); the tied lm_head is wte, counted once."""
    C, b = c.n_embd, c.bias
    # 4 matrices, 2 LayerNorm gains, 9C + 2C biases
    block = 12 * C * C + 2 * C + (11 * C if b else 0)
    P = (c.vocab_size + c.block_size) * C + c.n_layer * block + C * (2 if b else 1)
    n = 2 + c.n_layer * (12 if b else 6) + (2 if b else 1)
    # the scalar head: Linear(C, 1) with bias
    return (P + C + 1, n + 2) if c.head == "scalar" else (P, n)


def state_bytes(c, trainable, w=4, world=1, shard="ddp"):
    """Bytes one resident GPT holds on one rank: weights (w bytes each: 4 fp32, 2 bf16), and if it
    trains with AdamW, grads (w bytes), m and v (fp32), torch's 4-byte step count per tensor, and an
    fp32 master copy when w < 4 (mixed precision: ZeRO's 2 + 2 + 12 bytes per parameter,
    Rajbhandari et al. 2020). shard: "ddp" every rank holds it all; "zero1" the optimizer state is
    split over `world` ranks; "fsdp" weights, grads and optimizer state are all split (ZeRO-3)."""
    P, n = n_params(c)
    s = {"weights": w * P, "grads": w * P if trainable else 0,
         "optimizer": 8 * P + 4 * n + (4 * P if w < 4 else 0) if trainable else 0}
    split = {"ddp": (), "zero1": ("optimizer",), "fsdp": ("weights", "grads", "optimizer")}[shard]
    s = {k: v / world if k in split else v for k, v in s.items()}
    return {**s, "total": sum(s.values())}


def iteration_flops(c, job, B, T, K, P=0, epochs=4, L=0, share=0.0, sampling=0.0):
    """FLOPs of one iteration of `job` by phase, as the loops run it (hardware FLOPs: padding
    included); c: the policy's GPTConfig (critic and r_φ are the same transformer with a one-unit
    head). K: the positions with a target, where the LM head runs (model.sequence_logprobs).
      dpo_cache, dpo_live, simpo: B pairs, (2B, T) rows [chosen; rejected] with K response tokens:
          the policy's forward and backward, and (live) π_ref's forward; the cache's reference is
          a lookup, and SimPO's loss has none
      ppo: B rollouts of T columns, P of them prompt, K sampled tokens: the rollout engine samples
          them (KV cache), r_φ scores, policy (old log-probs), π_ref and critic run forward,
          `epochs` passes of forward + backward update (here over the whole (B, T) batch; ppo.py
          cuts each micro-batch to its own lengths, so it runs somewhat less)
      grpo: ppo's without the critic: B completions (groups of group_size of B / group_size
          prompts) sampled and scored, π_ref and π_old forward, `epochs` passes of the policy alone
      online_dpo: B prompts, two completions each (online_dpo.py's round, one micro-batch): the
          rollout engine samples (2B, L) rows, P columns of them prompt (KV cache), r_φ scores
          them, then dpo_live's work on the B labelled pairs, (2B, T) rows with K targets.
      iterative_dpo: one dpo.py step on B pairs the policy sampled (online DPO's shapes), and its
          share of the round's batch jobs: two completions of each of sampling·B prompts, and
          π_ref's precompute of share·B pairs (a round of --pairs pairs for --steps steps of B:
          share = pairs / (steps·B); it samples --pairs prompts or more: round_share)."""
    f, s = estimate_flops, replace(c, head="scalar")
    if job == "iterative_dpo":
        return {"rollout": sampling * generate_flops(c, 2 * B, P, L - P),
                "precompute": share * f(c, 2 * B, T, outputs=K),
                "policy": f(c, 2 * B, T, backward=True, outputs=K)}
    if job == "online_dpo":
        return {"rollout": generate_flops(c, 2 * B, P, L - P), "reward": f(s, 2 * B, L),
                "reference": f(c, 2 * B, T, outputs=K),
                "policy": f(c, 2 * B, T, backward=True, outputs=K)}
    if job == "ppo":
        return {"rollout": generate_flops(c, B, P, T - P), "reward": f(s, B, T),
                "ref_critic": 2 * f(c, B, T, outputs=K) + f(s, B, T),
                "update": epochs * (f(c, B, T, backward=True, outputs=K)
                                    + f(s, B, T, backward=True))}
    if job == "grpo":
        return {"rollout": generate_flops(c, B, P, T - P), "reward": f(s, B, T),
                "ref_old": 2 * f(c, B, T, outputs=K),
                "update": epochs * f(c, B, T, backward=True, outputs=K)}
    return {"policy": f(c, 2 * B, T, backward=True, outputs=K),
            "reference": f(c, 2 * B, T, outputs=K) if job == "dpo_live" else 0}


JOBS = {  # what each training job holds: (model, head, trains)
    "ppo": [("policy", "lm", True), ("critic", "scalar", True), ("reference", "lm", False),
            ("reward model", "scalar", False), ("rollout copy", "lm", False)],
    "grpo": [("policy", "lm", True), ("reference", "lm", False),
             ("reward model", "scalar", False), ("rollout copy", "lm", False)],
    "online_dpo": [("policy", "lm", True), ("reference", "lm", False),
                   ("reward model", "scalar", False), ("rollout copy", "lm", False)],
    # its training job is dpo.py's; the sampling (the policy, frozen) and the precompute (π_ref,
    # frozen) run between rounds as batch jobs, each alone on the machine
    "iterative_dpo": [("policy", "lm", True)],
    "dpo_live": [("policy", "lm", True), ("reference", "lm", False)],
    "dpo_cache": [("policy", "lm", True)],
    # its loss has no π_ref: no reference model, no cache
    "simpo": [("policy", "lm", True)]}
LABEL = {"ppo": "PPO", "grpo": "GRPO", "online_dpo": "online DPO",
         "iterative_dpo": "iterative DPO", "dpo_live": "DPO, live π_ref",
         "dpo_cache": "DPO, cached log π_ref", "simpo": "SimPO (no π_ref)",
         "precompute": "precompute (once)"}
IT = iterative_dpo.Config  # iterative DPO's defaults: the round its cost row shares
# The 7B extrapolation: a GPT with Llama-2-7B's depth, width, heads and vocabulary (bias-free, tied
# embeddings: 6.58B parameters against Llama's 6.74B, whose SwiGLU MLP has 3x11008 columns to our
# 2x16384). Every sequence: prompt_len prompt tokens + the rest response, no padding.
BIG = dict(n_layer=32, n_head=32, n_embd=4096, vocab_size=32000, seq_len=512, prompt_len=256,
           gpus=8, weight_bytes=2, pairs=60_000, batch_pairs=64, ppo_epochs=4)


def round_share(n):
    """The share of n prompts (or pairs) handled once per iterative DPO round that one of its
    steps carries, in units of the step's batch: n / (steps · B)."""
    return n / (IT.steps * IT.batch_size)


# the share of a round's precompute one step carries (its pairs), and of its sampling when the
# round samples no more prompts than it keeps pairs
ITERATIVE_SHARE = round_share(IT.pairs)


def cache_bytes(job, n_pairs, n_val):
    """Bytes of the log π_ref cache a job reads, 2 fp32 a pair: the pool's n_pairs (train and
    val), or a round's pairs and the n_val val pairs (iterative DPO); the rest read none."""
    return 8 * {"dpo_cache": n_pairs, "iterative_dpo": IT.pairs + n_val}.get(job, 0)


def iterative_sampled(runs):
    """Prompts sampled per round by iterative_dpo.py's runs, as run: runs, comma-separated
    folders or globs of them, each holding a rounds.json; returns the mean of "sampled" over every
    round they finished, the files and the rounds read. A round samples batches of --pairs
    prompts, two completions each, until it holds --pairs pairs: a pair with an unfinished, empty
    or identical completion is skipped, and a round short of pairs samples a whole batch more
    (iterative_dpo.MAX_BATCHES). No runs: the nominal round, IT.pairs prompts."""
    files = []
    for pattern in [r.strip() for r in runs.split(",") if r.strip()]:
        found = sorted(glob.glob(os.path.join(pattern, "rounds.json")))
        check(found, f"--iterative_runs: no rounds.json in {pattern}")
        files += found
    sampled = []
    for path in files:
        with open(path) as f:
            state = json.load(f)
        got = {k: state["config"][k] for k in ("pairs", "steps", "batch_size")}
        want = {k: getattr(IT, k) for k in got}
        check(got == want, f"--iterative_runs: {path} ran rounds of {got}; the cost row is "
              f"iterative_dpo.py's default round, {want}")
        sampled += [r["sampled"] for r in state["rounds"]]
    check(sampled or not files, f"--iterative_runs: no finished round in {', '.join(files)}")
    return dict(sampled=statistics.mean(sampled) if sampled else IT.pairs, runs=files,
                rounds=len(sampled))


# -----------------------------------------------------------------------------
# Measuring at π_ref's size

def measured_bytes(m, opt=None):
    """Bytes m's tensors hold on this rank: parameters (a tied one once), their grads, and opt's
    state for them; of a DTensor (--fsdp), the shard this rank holds."""
    nbytes = lambda t: (t.to_local() if isinstance(t, DTensor) else t).nbytes  # noqa: E731
    ps = list(m.parameters())
    s = {"weights": sum(nbytes(p) for p in ps),
         "grads": sum(nbytes(p.grad) for p in ps if p.grad is not None),
         "optimizer": sum(nbytes(t) for p in ps for t in (opt.state[p].values() if opt else ())
                          if torch.is_tensor(t))}
    return {**s, "total": sum(s.values())}


def rank_state(c=GPTConfig(n_layer=4, n_head=4, n_embd=64, block_size=64)):
    """Under torchrun: what one trained GPT of config c (main: π_ref's) holds on each rank after a
    backward and an AdamW step, wrapped by plumbing.wrap as the stages wrap it: DDP, then --fsdp.
    Returns {shard: {"ranks": [measured_bytes of each rank], "analytic": state_bytes}} (fp32:
    this is the CPU's training; state_bytes' 4 bytes per parameter). FSDP splits every tensor's
    rows over the ranks, so the ranks' weights, grads and Adam moments add up to DDP's one copy;
    AdamW's step counts (4 bytes per tensor) stay whole on every rank, which state_bytes, splitting
    the whole optimizer state, counts as split."""
    d = init_distributed()
    out = {}
    for shard in ("ddp", "fsdp"):
        torch.manual_seed(0)
        raw = GPT(c).to(d.device)
        model = wrap(raw, d, fsdp=shard == "fsdp")
        opt = adamw(raw, 1e-3, 0.1)
        x = torch.randint(0, c.vocab_size, (2, c.block_size), device=d.device)
        sequence_logprobs(model, x, x).sum().backward()
        opt.step()
        me = measured_bytes(raw, opt)
        mine = torch.zeros(d.world, len(me), dtype=torch.float64, device=d.device)
        mine[d.rank] = torch.tensor(list(me.values()), dtype=torch.float64)
        rows = all_reduce_sum(mine, d).tolist()
        out[shard] = {"ranks": [dict(zip(me, map(int, r))) for r in rows],
                      "analytic": state_bytes(c, True, 4, d.world, shard)}
    teardown(d)
    return out


def dpo_batches(examples, batch_size, micro_batch_size, seed, steps=None):
    """The pair micro-batches dpo.py's training runs (length-sorted global batches cut into
    contiguous micro-batches, all ranks' together: the same on any world size when each rank's
    share divides into them), over `steps` steps (default one epoch). A list of example lists."""
    lengths = [data.longest_row(e) for e in examples]
    steps = len(examples) // batch_size if steps is None else steps
    out = []
    for step in range(steps):
        g = data.global_batch(len(examples), batch_size, step, seed, lengths)
        out += [[examples[j] for j in g[i:i + micro_batch_size]]
                for i in range(0, batch_size, micro_batch_size)]
    return out


def reference_flops(c, batches, pad):
    """Hardware FLOPs of π_ref's forward over these pair batches, as pair_logps runs it."""
    total = 0
    for rows in batches:
        b = data.collate_pairs(rows, pad)
        K = int((b["targets"] != IGNORE).sum())
        total += estimate_flops(c, *b["input_ids"].shape, outputs=K)
    return total


def layouts(task_dir, sft):
    """{job: {"tokens", "padded", "packed"}}: the real tokens of the pair batches dpo.py (one
    epoch at its default sizes), precompute.py and reward.py (one epoch) build, and the positions
    each layout runs them in: padded (data.collate_pairs) and packed (data.pack_pairs). No model
    runs."""
    tok = data.load_tokenizer(tokenizer_beside(sft, "--sft"))
    D, P, R = dpo.Config, precompute.Config, reward.Config
    pairs = lambda s, n, p: data.tokenize_pairs(  # noqa: E731
        tok, data.read_pairs(f"{task_dir}/pairs_{s}.jsonl"), n, p)[0]
    train, val = pairs("train", D.max_len, D.max_prompt_len), pairs("val", D.max_len,
                                                                    D.max_prompt_len)
    # the precompute's batches: in order of length when padded, in the files' order when packed
    cut = lambda ex, n: [ex[i:i + n] for i in range(0, len(ex), n)]  # noqa: E731
    order = lambda ex, pack: ex if pack else sorted(ex, key=data.longest_row)  # noqa: E731
    pre = lambda pack: sum((cut(order(ex, pack), P.micro_batch_size)  # noqa: E731
                            for ex in (train, val)), [])
    block = load_model(sft)[0].config.block_size
    dpo_b = dpo_batches(train, D.batch_size, D.micro_batch_size, D.seed)
    rm_b = dpo_batches(pairs("train", block, R.max_prompt_len), R.batch_size, R.micro_batch_size,
                       R.seed)
    jobs = {"dpo.py, one epoch": (dpo_b, dpo_b, D.max_len),
            "precompute.py (train + val)": (pre(False), pre(True), P.max_len),
            "reward.py, one epoch": (rm_b, rm_b, block)}
    ids = lambda bs, n: [data.collate_pairs(b, tok.pad, n)["input_ids"] for b in bs]  # noqa: E731
    return {job: {"tokens": sum(int((x != tok.pad).sum()) for x in ids(padded, 0)),
                  "padded": sum(x.numel() for x in ids(padded, 0)),
                  "packed": sum(x.numel() for x in ids(packed, n))}
            for job, (padded, packed, n) in jobs.items()}


def measure_small(cfg, d, B=32, sampled=IT.pairs):
    """One iteration's model work of each job at π_ref's size on real pairs and prompts, with the
    calls the loops make (model.generate, model.pair_logps, forward + backward, an AdamW step).
    DPO's (and SimPO's) batch is the first micro-batch of dpo.py's first step (by length), PPO's
    the first B prompts, online DPO's two completions of each of them, GRPO's group_size
    completions of each of the first B / group_size; iterative DPO's round samples `sampled`
    prompts. Returns the GPTConfig, the FLOPs counted by phase, the shapes iteration_flops needs,
    the units (padded positions, real tokens, examples) and per model (the bytes its tensors hold,
    bytes per weight)."""
    tok = data.load_tokenizer(tokenizer_beside(cfg.sft, "--sft"))
    frozen = lambda m: m.eval().requires_grad_(False)  # noqa: E731
    policy, ref = load_model(cfg.sft, d.device)[0].eval(), frozen(load_model(cfg.sft, d.device)[0])
    critic = load_model(cfg.reward_model, d.device, head="scalar")[0]
    rm = frozen(load_model(cfg.reward_model, d.device, head="scalar")[0])
    rollout = frozen(copy.deepcopy(policy).to(  # as ppo.py
        torch.bfloat16 if d.device.type == "cuda" else torch.float32))
    c, D = policy.config, dpo.Config
    train, _ = data.tokenize_pairs(tok, data.read_pairs(f"{cfg.task}/pairs_train.jsonl"), D.max_len,
                                   D.max_prompt_len)
    b = data.collate_pairs(dpo_batches(train, D.batch_size, B, D.seed, steps=1)[0], tok.pad)
    x, y = b["input_ids"].to(d.device), b["targets"].to(d.device)  # (2B, T)
    _, f_policy = count_flops(lambda: pair_logps(policy, x, y).sum().backward())
    prompts = [data.encode_prompt(tok, p)
               for p in data.read_prompts(f"{cfg.task}/prompts_train.jsonl")[:B]]
    with torch.no_grad():
        _, f_ref = count_flops(lambda: pair_logps(ref, x, y))
        P, g = max(map(len, prompts)), torch.Generator(device=d.device).manual_seed(0)
        out, f_roll = count_flops(lambda: generate(rollout, prompts, c.block_size - P, tok.eos,
                                                   tok.pad, generator=g))
        t, m = out["tokens"], out["mask"]  # (B, P + N)
        # the token each column predicts, where it is a sampled one (ppo.py's `full`)
        targets = lambda o: F.pad(o["tokens"][:, 1:].masked_fill(  # noqa: E731
            ~o["response_mask"][:, 1:], IGNORE), (0, 1), value=IGNORE)
        tg = targets(out)
        _, f_rm = count_flops(lambda: rm(t, mask=m))
        _, f_rc = count_flops(lambda: (sequence_logprobs(policy, t, tg, m),
                                       sequence_logprobs(ref, t, tg, m), critic(t, mask=m)))
    _, f_up = count_flops(lambda: [(sequence_logprobs(policy, t, tg, m).sum()
                                    + critic(t, mask=m).sum()).backward()
                                   for _ in range(ppo.Config.ppo_epochs)])
    # online DPO's round on the same prompts (online_dpo.py): two completions of each from the
    # rollout copy (rows [prompts; prompts], one row of uniforms each), r_φ's labels, then the pairs
    # through π_ref and the policy
    U = torch.rand(2 * B, c.block_size - P, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        on, f_o_roll = count_flops(lambda: generate(rollout, prompts + prompts, c.block_size - P,
                                                    tok.eos, tok.pad, uniforms=U.to(d.device)))
        s, f_o_rm = count_flops(
            lambda: score_at_last(rm(on["tokens"], mask=on["mask"]).float(), on["mask"]))
        ys = [row[k].tolist() for row, k in zip(on["tokens"], on["response_mask"])]
        a_chosen, _ = online_dpo.label_pairs(s[:B], s[B:])
        pairs = [dict(index=j, prompt=p, chosen=a if w else b, rejected=b if w else a)
                 for j, (p, a, b, w) in enumerate(zip(prompts, ys[:B], ys[B:], a_chosen.tolist()))]
        ob = data.collate_pairs(pairs, tok.pad)
        xo, yo = ob["input_ids"].to(d.device), ob["targets"].to(d.device)  # (2B, T)
        _, f_o_ref = count_flops(lambda: pair_logps(ref, xo, yo))
    _, f_o_pol = count_flops(lambda: pair_logps(policy, xo, yo).sum().backward())
    # GRPO's iteration (grpo.py): group_size completions of each prompt, scored by r_φ, π_ref and
    # π_old forward, then ppo_epochs passes through the policy alone: PPO's without the critic
    G = grpo.Config.group_size
    gp = [p for p in prompts[:B // G] for _ in range(G)]
    with torch.no_grad():
        Pg, gg = max(map(len, gp)), torch.Generator(device=d.device).manual_seed(2)
        gr, f_g_roll = count_flops(lambda: generate(rollout, gp, c.block_size - Pg, tok.eos,
                                                    tok.pad, generator=gg))
        tq, mq, tgq = gr["tokens"], gr["mask"], targets(gr)  # (B, Pg + N)
        _, f_g_rm = count_flops(lambda: rm(tq, mask=mq))
        _, f_g_ro = count_flops(lambda: (sequence_logprobs(ref, tq, tgq, mq),
                                         sequence_logprobs(policy, tq, tgq, mq)))
    _, f_g_up = count_flops(lambda: [sequence_logprobs(policy, tq, tgq, mq).sum().backward()
                                     for _ in range(grpo.Config.ppo_epochs)])
    opts = [torch.optim.AdamW(mod.parameters()) for mod in (policy, critic)]
    for o in opts:
        o.step()  # AdamW allocates m, v and the step counts on its first step
    flops = {"ppo": {"rollout": f_roll, "reward": f_rm, "ref_critic": f_rc, "update": f_up},
             "grpo": {"rollout": f_g_roll, "reward": f_g_rm, "ref_old": f_g_ro, "update": f_g_up},
             "online_dpo": {"rollout": f_o_roll, "reward": f_o_rm, "reference": f_o_ref,
                            "policy": f_o_pol},
             "dpo_live": {"policy": f_policy, "reference": f_ref},
             "dpo_cache": {"policy": f_policy, "reference": 0},
             # SimPO's step: the same forward and backward of the pairs, no π_ref at all
             "simpo": {"policy": f_policy, "reference": 0},
             # the same sampled pairs trained by dpo.py; the round's work counted, then shared
             "iterative_dpo": {"rollout": round_share(sampled) * f_o_roll,
                               "precompute": ITERATIVE_SHARE * f_o_ref, "policy": f_o_pol}}
    K_dpo, K_ppo = int((y != IGNORE).sum()), int(out["response_mask"].sum())
    shapes = {"ppo": dict(B=B, T=t.shape[1], K=K_ppo, P=P, epochs=ppo.Config.ppo_epochs),
              "grpo": dict(B=len(gp), T=tq.shape[1], K=int(gr["response_mask"].sum()), P=Pg,
                           epochs=grpo.Config.ppo_epochs),
              **{job: dict(B=B, T=xo.shape[1], K=int((yo != IGNORE).sum()), P=P,
                           L=on["tokens"].shape[1], **extra)
                 for job, extra in (("online_dpo", {}),
                                    ("iterative_dpo", dict(share=ITERATIVE_SHARE,
                                                           sampling=round_share(sampled))))},
              **{job: dict(B=B, T=x.shape[1], K=K_dpo)
                 for job in ("dpo_live", "dpo_cache", "simpo")}}
    dpo_units = dict(positions=x.numel(), tokens=int((x != tok.pad).sum()), examples=B)
    on_units = dict(positions=xo.numel(), tokens=int((xo != tok.pad).sum()), examples=B)
    units = {"ppo": dict(positions=t.numel(), tokens=int(m.sum()), examples=B),
             "grpo": dict(positions=tq.numel(), tokens=int(mq.sum()), examples=len(gp)),
             "online_dpo": on_units, "dpo_live": dpo_units, "dpo_cache": dpo_units,
             "simpo": dpo_units, "iterative_dpo": on_units}
    models = {"policy": (policy, opts[0]), "critic": (critic, opts[1]), "reference": (ref, None),
              "reward model": (rm, None), "rollout copy": (rollout, None)}
    held = {k: (measured_bytes(mod, o), next(mod.parameters()).element_size())
            for k, (mod, o) in models.items()}
    return c, flops, shapes, units, held


def precompute_payback(cfg, d, cache_dir):
    """The precompute against what it replaces, in hardware FLOPs counted on the real batches: its
    own pass (read from the cache files the timed run wrote) against the live π_ref forwards of one
    epoch of dpo.py's training steps (at the default batch sizes) and of one evaluation of the val
    pairs (dpo.evaluate_pairs' micro-batches, in order of length)."""
    tok = data.load_tokenizer(tokenizer_beside(cfg.sft, "--sft"))
    c, D = load_model(cfg.sft)[0].config, dpo.Config
    res = {}
    for split in ("train", "val"):
        with safe_open(os.path.join(cache_dir, f"{split}.safetensors"), "pt") as f:
            res[f"precompute_{split}"] = json.loads(f.metadata()["cost"])["flops"]
    pairs = lambda s: data.tokenize_pairs(  # noqa: E731
        tok, data.read_pairs(f"{cfg.task}/pairs_{s}.jsonl"), D.max_len, D.max_prompt_len)[0]
    train, val = pairs("train"), sorted(pairs("val"), key=data.longest_row)
    mb = min(D.micro_batch_size, D.batch_size // d.world)  # pairs per forward, as split_batch
    epoch = len(train) // D.batch_size
    one_epoch = dpo_batches(train, D.batch_size, mb, D.seed)
    one_eval = [val[i:i + D.micro_batch_size] for i in range(0, len(val), D.micro_batch_size)]
    res.update(epoch_steps=epoch, eval_every=D.eval_every,
               live_per_step=reference_flops(c, one_epoch, tok.pad) / epoch,
               live_per_eval=reference_flops(c, one_eval, tok.pad))
    res.update(steps=res["precompute_train"] / res["live_per_step"],
               evals=res["precompute_val"] / res["live_per_eval"])
    return res


def timed_runs(cfg, d, say):
    """Wall time of the real loops at their default sizes, interleaved: each round runs a few
    iterations of PPO and GRPO and rounds of online DPO, dpo.py's steps with the live reference,
    with the cache and under SimPO's loss (no reference; stopped before they evaluate), and the
    whole precompute. Per round and job: the median step (the first warms up, dropped), its phases
    and tokens/s from the stage's metrics.jsonl, and on CUDA the peak memory allocated."""
    root, n = os.path.join(cfg.out_dir, "timing"), cfg.time_steps
    t = lambda f: os.path.join(cfg.task, f)  # noqa: E731
    dc = dict(ref_model=cfg.sft, train_pairs=t("pairs_train.jsonl"),
              val_pairs=t("pairs_val.jsonl"), test_prompts=t("prompts_test.jsonl"),
              ref_logps=cfg.ref_logps, steps=n + 1, stop_after=n, eval_every=10 ** 6, resume=False)
    rl = dict(sft=cfg.sft, reward_model=cfg.reward_model, prompts=t("prompts_train.jsonl"),
              test_prompts=t("prompts_test.jsonl"), iterations=n + 1, stop_after=n, resume=False)
    jobs = {"ppo": lambda: ppo.main(ppo.Config(out_dir=f"{root}/ppo", **rl)),
            "grpo": lambda: grpo.main(grpo.Config(out_dir=f"{root}/grpo", **rl)),
            "online_dpo": lambda: online_dpo.main(online_dpo.Config(
                out_dir=f"{root}/online_dpo", **rl)),
            "dpo_live": lambda: dpo.main(dpo.Config(out_dir=f"{root}/dpo_live", ref="live", **dc)),
            "dpo_cache": lambda: dpo.main(dpo.Config(out_dir=f"{root}/dpo_cache", ref="cache",
                                                     **dc)),
            # SimPO's β: its paper's (dpo.Config's comment); the cost is the same at any β
            "simpo": lambda: dpo.main(dpo.Config(out_dir=f"{root}/simpo", loss="simpo", beta=2,
                                                 **dc)),
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
                med = {k: statistics.median(s[k] for s in steps) for k in steps[0]
                       if k.startswith(("time/", "tokens_", "mfu"))}
                # dpo.py's and ppo.py's (and grpo.py's, online_dpo.py's) totals; other time/ keys
                # are phases
                whole = ("time/step", "time/iteration")
                row["phases"] = {k[5:].removesuffix("_ms"): v for k, v in med.items()
                                 if k.startswith("time/") and k not in whole}
                row.update(ms=next((med[k] for k in whole if k in med),
                                   sum(row["phases"].values())),
                           tokens_per_sec=med["tokens_per_sec"], mfu=med["mfu"],
                           mfu_hardware=med["mfu_hardware"])
    return rounds


def iterative_step(r, sampled, n_pairs):
    """Iterative DPO's step in timing round r (ms), composed of the measured parts it runs: the
    cached DPO step, and its share of its round's batch jobs: two completions of each of
    sampled / steps prompts at online DPO's rollout time per prompt, and the precompute of
    pairs / steps pairs at the precompute's time per pair (of n_pairs)."""
    ph = dict(sampling=sampled / IT.steps * r["online_dpo"]["phases"]["rollout"]
              / online_dpo.Config.rollout_batch,
              precompute=IT.pairs / IT.steps * r["precompute"]["ms"] / n_pairs,
              step=r["dpo_cache"]["ms"])
    return {"ms": sum(ph.values()), "phases": ph}


def costs(cfg, d, say):
    """Everything at π_ref's size, analytic beside measured, and the 7B extrapolation: costs.json's
    dict. Iterative DPO's rounds sample the prompts cfg.iterative_runs' rounds sampled (none
    given: the nominal IT.pairs)."""
    it = iterative_sampled(cfg.iterative_runs)
    say("[costs] counting the FLOPs and bytes of one iteration of each job at π_ref's size")
    c, flops, shapes, units, models = measure_small(cfg, d, sampled=it["sampled"])
    n_val = len(data.read_pairs(f"{cfg.task}/pairs_val.jsonl"))
    n_pairs = n_val + len(data.read_pairs(f"{cfg.task}/pairs_train.jsonl"))
    rounds = timed_runs(cfg, d, say)
    if not d.is_main:
        return None
    for r in rounds:
        r["iterative_dpo"] = iterative_step(r, it["sampled"], n_pairs)
    res = {"model": asdict(c), "params": n_params(c)[0], "device": str(d.device), "world": d.world,
           "threads": torch.get_num_threads(), "n_pairs": n_pairs, "jobs": {}, "rounds": rounds}
    for job, held in JOBS.items():
        mods = {k: {"trainable": tr, "measured": models[k][0],
                    "analytic": state_bytes(replace(c, head=h), tr, w=models[k][1])}
                for k, h, tr in held}
        peak = [r[job]["peak_bytes"] for r in rounds if "peak_bytes" in r[job]]
        res["jobs"][job] = dict(
            models=mods, cache_bytes=cache_bytes(job, n_pairs, n_val),
            flops_analytic=iteration_flops(c, job, **shapes[job]), flops_counted=flops[job],
            units=units[job], peak_bytes=max(peak, default=None),
            **{f"bytes_{k}": {s: sum(m[k][s] for m in mods.values()) for s in mods["policy"][k]}
               for k in ("analytic", "measured")})
    # wall time: medians over the rounds, of each job and of the ratios taken within each round
    med = lambda f: statistics.median(f(r) for r in rounds)  # noqa: E731
    for job in LABEL:
        res["jobs"].setdefault(job, {})["time"] = dict(
            ms=med(lambda r: r[job]["ms"]),
            per_dpo_cached=med(lambda r: r[job]["ms"] / r["dpo_cache"]["ms"]),
            **{k: med(lambda r: r[job].get(k, 0))
               for k in ("tokens_per_sec", "mfu", "mfu_hardware")},
            phases={k: statistics.median(r[job]["phases"][k] for r in rounds)
                    for k in rounds[0][job]["phases"]})
    res["payback_steps"] = med(lambda r: r["precompute"]["ms"]
                               / max(r["dpo_live"]["ms"] - r["dpo_cache"]["ms"], 1e-9))
    res["payback_flops"] = precompute_payback(cfg, d, f"{cfg.out_dir}/timing/ref_logps")
    res["layouts"] = layouts(cfg.task, cfg.sft)
    # iterative DPO's row at the nominal round and as run, side by side: wall, FLOPs per real
    # token, FLOPs per token at 7B, each against cached DPO's
    per_token = lambda fl, job: sum(fl.values()) / units[job]["tokens"]  # noqa: E731
    cached = per_token(flops["dpo_cache"], "dpo_cache")
    for k, n in (("nominal", IT.pairs), ("as_run", it["sampled"])):
        fl = iteration_flops(c, "iterative_dpo", **{**shapes["iterative_dpo"],
                                                    "sampling": round_share(n)})
        big = at_7b(sampled=n)["jobs"]
        it[k] = dict(sampled=n, ms=med(lambda r: iterative_step(r, n, n_pairs)["ms"]),
                     per_dpo_cached=med(lambda r: iterative_step(r, n, n_pairs)["ms"]
                                        / r["dpo_cache"]["ms"]),
                     flops_per_dpo_cached=per_token(fl, "iterative_dpo") / cached,
                     flops_per_dpo_cached_7b=big["iterative_dpo"]["flops_per_token"]
                     / big["dpo_cache"]["flops_per_token"])
    res["iterative"] = it
    return {**res, "at_7b": at_7b(sampled=it["sampled"])}


def at_7b(a=BIG, sampled=IT.pairs):
    """The same analytic functions at a Llama-2-7B-sized GPT: bytes per GPU under DDP, ZeRO-1 and
    FSDP, FLOPs per token, and the steps after which the precompute has paid for itself; iterative
    DPO's rounds sample `sampled` prompts."""
    big = GPTConfig(block_size=a["seq_len"], vocab_size=a["vocab_size"], n_layer=a["n_layer"],
                    n_head=a["n_head"], n_embd=a["n_embd"], bias=False)
    res = {"assumptions": a, "params": n_params(big)[0], "jobs": {}}
    T, P = a["seq_len"], a["prompt_len"]
    for job, held in JOBS.items():
        rows = 1 if job in ("ppo", "grpo") else 2  # a rollout, or a pair's [chosen; rejected]
        fl = iteration_flops(big, job, 1, T, rows * (T - P), P, a["ppo_epochs"], L=T,
                             share=ITERATIVE_SHARE, sampling=round_share(sampled))
        gpu = {sh: sum(state_bytes(replace(big, head=h), tr, a["weight_bytes"], a["gpus"],
                                   sh)["total"] for _, h, tr in held)
               for sh in ("ddp", "zero1", "fsdp")}
        res["jobs"][job] = {"flops_by_phase": fl, "bytes_per_gpu": gpu,
                            "flops_per_token": sum(fl.values()) / (rows * T)}
    # what the cache saves a step, against one forward of π_ref over every pair
    saved = iteration_flops(big, "dpo_live", a["batch_pairs"], T, 2 * a["batch_pairs"] * (T - P))
    once = estimate_flops(big, 2 * a["pairs"], T, outputs=2 * a["pairs"] * (T - P))
    return {**res, "payback_steps": once / saved["reference"]}


def table(head, rows):
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                     + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


def size(b):
    return f"{b / 2**30:,.1f} GiB" if b >= 2**30 else f"{b / 2**20:,.2f} MiB"


UNITS = (("positions", "padded position"), ("tokens", "real token"), ("examples", "example"))


def layout_table(lay):
    """layouts' result as markdown: a heading, the table, what the two layouts are."""
    rows = [[job, f"{r['tokens']:,}", f"{r['padded']:,}", f"{r['padded'] / r['tokens']:.3f}",
             f"{r['packed']:,}", f"{r['packed'] / r['tokens']:.3f}"] for job, r in lay.items()]
    return "\n".join([
        "### Positions per real token: pair batches padded and packed", "",
        table(["batches", "real tokens", "padded positions", "per real token",
               "packed positions", "per real token"], rows), "",
        "Padded: each micro-batch's [chosen; rejected] rows right-padded to its longest row "
        "(data.collate_pairs, after the length sort of data.global_batch). Packed: the same "
        "sequences whole in rows of max_len tokens (reward.py: block_size), first-fit "
        "decreasing (data.pack_pairs), which dpo.py, precompute.py and reward.py run by default. "
        "Attention still runs max_len x max_len per row."])


def costs_markdown(res, cfg):
    ok = lambda good: " ✓" if good else " ✗"  # noqa: E731
    c, J, a = GPTConfig(**res["model"]), res["jobs"], res["at_7b"]["assumptions"]
    B = res["at_7b"]["jobs"]
    held, flop, wall = [], [], []
    for job in JOBS:
        r, an, me = J[job], J[job]["bytes_analytic"], J[job]["bytes_measured"]
        held.append([LABEL[job], ", ".join(f"{k} ({'trains' if m['trainable'] else 'frozen'})"
                                           for k, m in r["models"].items()),
                     *map(size, an.values()), size(me["total"]) + ok(me == an),
                     size(r["cache_bytes"]) if r["cache_bytes"] else "–",
                     size(r["peak_bytes"]) if r["peak_bytes"] else "not measured (CPU)"])
        fl, u, cnt = r["flops_analytic"], r["units"], r["flops_counted"]
        per = lambda v: [f"{v / u['positions'] / 1e3:,.1f}",  # noqa: E731
                         f"{v / u['tokens'] / 1e3:,.1f}", f"{v / u['examples'] / 1e6:,.2f}"]
        flop += [[LABEL[job], k, f"{v / 1e6:,.1f}", f"{cnt[k] / 1e6:,.1f}" + ok(v == cnt[k]),
                  *per(v)] for k, v in fl.items()]
        tot = sum(fl.values())
        flop.append([f"**{LABEL[job]}**", "**total**", f"**{tot / 1e6:,.1f}**", "",
                     *(f"**{v}**" for v in per(tot))])
    per_ex = {"ppo": (ppo.Config.rollout_batch, "rollouts"),
              "grpo": (grpo.Config.rollout_batch, "rollouts"),
              "online_dpo": (online_dpo.Config.rollout_batch, "pairs"),
              "iterative_dpo": (IT.batch_size, "pairs"),
              "dpo_live": (dpo.Config.batch_size, "pairs"),
              "dpo_cache": (dpo.Config.batch_size, "pairs"),
              "simpo": (dpo.Config.batch_size, "pairs"),
              "precompute": (res["n_pairs"], "pairs (train + val)")}
    for job, (n, unit) in per_ex.items():
        t = J[job]["time"]
        wall.append([LABEL[job], f"{t['ms']:,.0f}", f"{n} {unit}", f"{t['ms'] / n:.2f}",
                     f"{t['tokens_per_sec']:,.0f}" if t["tokens_per_sec"] else "–",
                     f"{t['mfu']:.1%} / {t['mfu_hardware']:.1%}" if t["mfu"] else "–",
                     f"{t['per_dpo_cached']:.1f}×" if job != "precompute"
                     else f"= {t['per_dpo_cached']:.0f} cached steps",
                     " · ".join(f"{k} {v:,.0f}" for k, v in t["phases"].items())
                     or "(the whole run)"])
    total = lambda job, k: sum(J[job]["flops_analytic"].values()) / J[job]["units"][k]  # noqa: E731
    ratios = lambda job: ", ".join(  # noqa: E731
        f"{total(job, k) / total('dpo_cache', k):.1f}× per {name}" for k, name in UNITS)
    units = "; ".join(f"{LABEL[job]}: {u['examples']} examples, {u['positions']:,} positions, "
                      f"{u['tokens']:,} of them real tokens"
                      for job in ("ppo", "grpo", "online_dpo", "dpo_cache")
                      for u in [J[job]["units"]])
    pb, E = res["payback_flops"], res["payback_flops"]["epoch_steps"]
    big = [[LABEL[job], len(JOBS[job]),
            *(size(r["bytes_per_gpu"][s]) for s in ("ddp", "zero1", "fsdp")),
            f"{r['flops_per_token'] / 1e9:.1f}",
            f"{r['flops_per_token'] / B['dpo_cache']['flops_per_token']:.1f}×"]
           for job, r in B.items()]
    gflop = lambda k: f"{pb[k] / 1e9:,.2f} GFLOP"  # noqa: E731
    it, given = res["iterative"], "rounds.json given to study.compare --iterative_runs"
    source = (f"as run: the mean of the {it['rounds']} rounds of the runs named under the wall "
              "times" if it["runs"] else f"assumed nominal: no {given}")
    cost = lambda v: (  # noqa: E731
        f"{v['ms']:,.0f} ms and {v['per_dpo_cached']:.1f}× DPO cached's wall per step, "
        f"{v['flops_per_dpo_cached']:.1f}× its FLOPs per real token, "
        f"{v['flops_per_dpo_cached_7b']:.2f}× its FLOPs per token at 7B")
    as_run = (f"as run ({it['sampled']:,.0f} prompts a round, the mean of the {it['rounds']} "
              f"rounds in {', '.join(it['runs'])}): {cost(it['as_run'])}"
              if it["runs"] else f"as run: not measured (no {given}), so every row above "
              "assumes the nominal count")
    return "\n".join([
        f"## Costs at π_ref's size: {c.n_layer} layers × {c.n_embd} wide, vocabulary "
        f"{c.vocab_size}, block {c.block_size} ({res['params'] / 1e6:.2f}M parameters), "
        f"{res['world']} × {res['device']}, {res['threads']} threads", "",
        "### What the training job holds (per rank; analytic, ✓ = the tensors' nbytes agree "
        "exactly)", "",
        table(["job", "models resident", "weights", "grads", "AdamW state", "total", "measured",
               "ref cache", "peak memory"], held), "",
        "Measured: the parameters' nbytes (a tied weight once), their grads after a backward, "
        "AdamW's state after a step. Peak memory: torch.cuda.max_memory_allocated over a timed "
        "run, on a GPU; the CPU keeps no allocator statistics, so there only the model state is "
        "known (activations come on top). Iterative DPO's training job is dpo.py's, the policy "
        "alone, its cache a round's pairs and the val pairs; between rounds a batch job samples "
        "from the policy (frozen), then the precompute reads π_ref (frozen), one at a time. "
        "SimPO's job holds the policy alone and reads no cache: its loss has no π_ref.", "",
        "### What a token costs (FLOPs of one iteration at real shapes; ✓ = torch's "
        "FlopCounterMode counts the same, its CPU attention kernels mapped to torch's own "
        "formulas by meter.count_flops)", "",
        table(["job", "phase", "analytic MFLOP", "counted MFLOP", "kFLOP per padded position",
               "kFLOP per real token", "MFLOP per example"], flop), "",
        "Three units, each stated: per padded position of the iteration's batch (DPO's and "
        "online DPO's (2B, T) pair rows, PPO's and GRPO's (B, T) rollouts, padding included), per "
        "real token (prompt and response, no padding), per example (a pair for DPO and online "
        "DPO, a rollout for PPO and GRPO). " + units + ". DPO's batch is the first micro-batch "
        "dpo.py runs (sorted by length), padded (--no-pack; packed, it runs the positions per "
        "real token of the next table); the LM head runs only where a target exists. PPO's "
        "rollout samples with the KV cache; its update is ppo_epochs passes through policy and "
        "critic. GRPO's iteration is PPO's without the critic: "
        f"{grpo.Config.group_size} completions of each of B / {grpo.Config.group_size} prompts, "
        "r_φ's scores, π_ref and π_old forward (ref_old), ppo_epochs passes through the policy "
        "alone. Online DPO's round samples two completions of each of PPO's prompts with the KV "
        "cache, r_φ scores all 2B, and the labelled pairs go through π_ref and the policy as in "
        f"live DPO. PPO against cached DPO: {ratios('ppo')}; GRPO against cached DPO: "
        f"{ratios('grpo')}; online DPO against cached DPO: {ratios('online_dpo')}; iterative "
        f"DPO against cached DPO: {ratios('iterative_dpo')}; SimPO against cached DPO: "
        f"{ratios('simpo')}. Iterative DPO's step is dpo.py's on pairs the policy sampled (so "
        "online DPO's pair shapes), plus its share of its round's batch jobs, online DPO's "
        "rollout and π_ref forward on the same pairs, counted and scaled: the precompute's "
        f"{ITERATIVE_SHARE:g} = {IT.pairs:,} pairs / ({IT.steps} × {IT.batch_size}), the "
        f"sampling's {round_share(it['sampled']):.4g} = {it['sampled']:,.0f} prompts / "
        f"({IT.steps} × {IT.batch_size}), two completions each ({source}). A round samples "
        f"batches of {IT.pairs:,} prompts until it holds {IT.pairs:,} pairs, a pair with an "
        "unfinished, empty or identical completion skipped (iterative_dpo.MAX_BATCHES). "
        "SimPO's step is cached DPO's forward and backward of the pairs, with no reference to "
        "look up.", "",
        layout_table(res["layouts"]), "",
        f"### Wall time of the real loops (median of {cfg.rounds} interleaved rounds, "
        f"{cfg.time_steps - 1} timed steps each)", "",
        table(["job", "ms per iteration", "examples", "ms per example", "real tokens/s",
               "MFU / HFU", "× DPO cached", "phases (ms)"], wall), "",
        "MFU: the FLOPs the real tokens need (6N per trained token, 2N per forward-only one, "
        "causal attention, the LM head only where a target exists; meter.model_flops) per "
        "second, over the device's matmul peak measured at the model's own shapes "
        "(meter.measure_peak_flops). HFU: the FLOPs actually executed (padding, full "
        "attention, recomputed scores included; meter.estimate_flops) over the same peak. "
        "MFU <= HFU <= 1. SimPO's row is its own dpo.py run (--loss simpo). Iterative DPO's "
        "row is composed of measured ones, not timed alone: the cached DPO step plus its share "
        f"of a round, {it['sampled'] / IT.steps:,.4g} prompts' two completions at online DPO's "
        f"rollout time per prompt (sampling) and {IT.pairs / IT.steps:g} pairs at the "
        "precompute's time per pair.", "",
        f"Iterative DPO nominal ({IT.pairs:,} prompts a round): {cost(it['nominal'])}; "
        f"{as_run}.", "",
        f"The precompute ran π_ref once over the pairs: {gflop('precompute_train')} for the "
        f"train pairs and {gflop('precompute_val')} for the val pairs, counted on its real "
        f"batches. A live reference runs {gflop('live_per_step')} per step on the train pairs "
        f"(the mean over an epoch of dpo.py's batches, {E} steps) and {gflop('live_per_eval')} "
        f"per evaluation of the val pairs (every {pb['eval_every']} steps and at the end). By "
        f"FLOPs the train cache pays back after {pb['steps']:.0f} steps "
        f"({pb['steps'] / E:.2f} epochs) and the val cache after {pb['evals']:.1f} "
        "evaluations. Both passes see every pair once, so without padding the train cache pays "
        "back after exactly one epoch (the 7B case below); here the precompute's batches, sorted "
        "by length, pad less than training's, which moves it earlier. Either way a run of about "
        "one epoch saves memory (π_ref off the job) more than FLOPs, and each later epoch saves "
        "π_ref's forward of every step. In wall time here it pays back "
        f"after {res['payback_steps']:.0f} steps of saved reference forwards (measured).",
        "", f"## The same functions at 7B on {a['gpus']} GPUs", "",
        f"A GPT with Llama-2-7B's shape: {a['n_layer']} layers × {a['n_embd']} wide, "
        f"{a['n_head']} heads, vocabulary {a['vocab_size']}, no biases, tied embeddings "
        f"({res['at_7b']['params'] / 1e9:.2f}B parameters). Weights in bf16; a trained model "
        "adds bf16 grads, an fp32 master copy and Adam's m and v (16 bytes per parameter); the "
        f"rollout copy (PPO's, GRPO's, online DPO's) is bf16. Sequences of {a['seq_len']} tokens, "
        f"{a['prompt_len']} prompt + {a['seq_len'] - a['prompt_len']} response, no padding (a "
        "position is a real token), the LM head on the response; online DPO samples both "
        f"completions of a pair; {a['ppo_epochs']} PPO and GRPO epochs, DPO batches of "
        f"{a['batch_pairs']} pairs from {a['pairs']:,}. Model state only: activations, the KV "
        "cache and communication buffers come on top.", "",
        table(["job", "models", "DDP per GPU", "ZeRO-1 per GPU", "FSDP per GPU",
               "GFLOP per token", "× DPO cached"], big), "",
        f"The precompute (one forward of π_ref over every pair) pays for itself after "
        f"{res['at_7b']['payback_steps']:.0f} steps: exactly the reference forwards a live job "
        "runs in one epoch, so a run of one epoch or less saves memory, not FLOPs. From then on "
        f"a step costs {B['dpo_cache']['flops_per_token'] / B['dpo_live']['flops_per_token']:.0%} "
        f"of a live one's FLOPs, and π_ref's {size(2 * res['at_7b']['params'])} of bf16 weights "
        "leave each GPU under DDP and ZeRO-1; under FSDP a GPU held only its shard of them "
        "(the FSDP column's live and cached rows). SimPO's job holds what cached DPO's does "
        "and runs the same FLOPs, with no precompute before it."])


@dataclass
class Config:  # `python -m study.costs`'s flags; the cost tables are study.compare's
    sft: str = "out/sft/model.safetensors"  # π_ref, whose shape (vocabulary included) is measured
    results: str = "RESULTS.md"  # its section "fsdp" gets the table ("": none)


def rank_state_markdown(res, c):
    """rank_state's result for config c as a table: per shard, the analytic bytes per rank, then
    each rank's."""
    body = []
    for shard, r in res.items():
        body.append([shard, "analytic (each)", *(f"{v:,.0f}" for v in r["analytic"].values())])
        body += [[shard, i, *(f"{v:,}" for v in m.values())] for i, m in enumerate(r["ranks"])]
    head = ["wrap", "rank", *(f"{k} bytes" for k in next(iter(res.values()))["analytic"])]
    return (f"## What one trained GPT holds on each rank: DDP against FSDP\n\n{table(head, body)}"
            f"\n\nπ_ref's shape ({c.n_layer} layers × {c.n_embd} wide, block {c.block_size}, "
            f"vocabulary {c.vocab_size}, "
            f"{n_params(c)[0]:,} parameters), fp32, after a backward and an AdamW step, wrapped by "
            "plumbing.wrap as the stages wrap it, on "
            f"{len(next(iter(res.values()))['ranks'])} ranks. Analytic: state_bytes, which splits "
            "the whole optimizer state under FSDP, while AdamW's 4-byte step counts stay whole on "
            "every rank: the little by which FSDP's measured optimizer bytes exceed it.")


def main(cfg):
    """torchrun --nproc_per_node=2 -m study.costs: DDP's and FSDP's state per rank, printed, and
    on rank 0 the section "fsdp" of --results."""
    t0 = time.time()
    check(os.path.exists(cfg.sft), f"{cfg.sft} does not exist: train π_ref first (python sft.py), "
          "whose shape this measures")
    c = load_model(cfg.sft)[0].config
    res = rank_state(c)
    if int(os.environ.get("RANK", "0")) == 0:
        for shard, r in res.items():
            analytic = ", ".join(f"{k} {v:,.0f}" for k, v in r["analytic"].items())
            print(f"{shard}: analytic per rank {analytic} bytes")
            for i, m in enumerate(r["ranks"]):
                print(f"  rank {i} measured " + ", ".join(f"{k} {v:,}" for k, v in m.items()))
        world = len(res["ddp"]["ranks"])
        device = "cuda" if torch.cuda.is_available() else "cpu"
        cmd = launcher(world) + " ".join(["-m study.costs"] + flags(cfg))
        if write_section(cfg.results, "fsdp", rank_state_markdown(res, c), cmd,
                         time.time() - t0, device, world):
            print(f"wrote the section fsdp of {cfg.results}")
        print(json.dumps(res))


if __name__ == "__main__":
    main(parse_config(Config, doc=__doc__))
