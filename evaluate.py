"""The evaluation every policy gets, DPO's and PPO's alike: true reward against KL from π_ref.

    python evaluate.py --policy out/dpo/model.safetensors        # any saved policy, one process
    torchrun --nproc_per_node=8 evaluate.py --policy out/ppo/model.safetensors

For each held-out prompt, sample k completions from the policy and k from π_ref (temperature 1, so the
samples are the distributions the KL is about). Report, as in Figure 2 of the DPO paper:
  true_reward   mean hidden reward of the policy's completions (the task's stand-in for a classifier)
  kl            KL(π‖π_ref) estimated by the mean over samples y ~ π of Σ_t log π(y_t|·) − log π_ref(y_t|·),
                summed over the response tokens with the same log-prob function training uses
  win_rate      P(reward of π's completion > π_ref's completion for the same prompt), ties count half
"""
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import data
from model import generate, load_model, sequence_logprobs
from plumbing import all_reduce_sum, atomic_write_json, init_distributed, parse_config, teardown


@torch.no_grad()
def completion_logps(model, out):
    """Summed log-probs (B,) of generate()'s response tokens under `model`: the logits at column t−1
    predict the token at column t, and only response tokens count."""
    targets = out["tokens"][:, 1:].masked_fill(~out["response_mask"][:, 1:], -100)
    targets = F.pad(targets, (0, 1), value=-100)  # (B, L): the last column predicts nothing
    return sequence_logprobs(model, out["tokens"], targets, mask=out["mask"]).sum(-1)


@torch.no_grad()
def evaluate_policy(policy, ref, tok, prompts, d, k=4, batch_size=64, seed=0, n_samples=3):
    """Sample, score and compare on `prompts` (a list of strings), sharded over ranks. Returns the
    DESIGN.md eval fields; `samples` holds the first few prompts with both models' completions."""
    was_training = policy.training
    policy.eval(), ref.eval()
    block = policy.config.block_size
    rows = [(p, data.encode_prompt(tok, p)) for p in prompts for _ in range(k)][d.rank::d.world]
    # Separate streams: π_ref's samples depend only on the seed, so every policy is compared with the
    # same π_ref baseline; and they are independent of the policy's even when the two models are equal.
    gens = [torch.Generator(device=d.device).manual_seed(s + d.rank) for s in (seed, seed + 1_000_003)]
    sums = torch.zeros(7, dtype=torch.float64, device=d.device)  # n, r, r², r_ref, r_ref², kl, wins
    samples = []
    for i in range(0, len(rows), batch_size):
        chunk = rows[i:i + batch_size]
        ids = [p[-(block // 2):] for _, p in chunk]  # leave room for the completion
        new = block - max(len(p) for p in ids)
        outs = [generate(m, ids, new, tok.eos, tok.pad, temperature=1.0, generator=g)
                for m, g in zip((policy, ref), gens)]
        texts = [[tok.decode(t[r].tolist()) for t, r in zip(o["tokens"], o["response_mask"])] for o in outs]
        r = torch.tensor([data.true_reward(p, y) for (p, _), y in zip(chunk, texts[0])], dtype=torch.float64)
        r_ref = torch.tensor([data.true_reward(p, y) for (p, _), y in zip(chunk, texts[1])], dtype=torch.float64)
        kl = (completion_logps(policy, outs[0]) - completion_logps(ref, outs[0])).double().cpu()
        wins = (r > r_ref).double() + 0.5 * (r == r_ref).double()
        sums += torch.stack([torch.tensor(float(len(chunk))), r.sum(), (r * r).sum(), r_ref.sum(),
                             (r_ref * r_ref).sum(), kl.sum(), wins.sum()]).to(d.device)
        samples += [{"prompt": p, "policy": y, "policy_reward": float(a), "ref": y_ref, "ref_reward": float(b)}
                    for j, ((p, _), y, y_ref, a, b) in enumerate(zip(chunk, texts[0], texts[1], r, r_ref))
                    if (i + j) % k == 0][:n_samples - len(samples)]  # one completion of each prompt
    n, r, r2, rr, rr2, kl, wins = all_reduce_sum(sums, d).tolist()
    policy.train(was_training)
    return {"true_reward": r / n, "true_reward_std": max(r2 / n - (r / n) ** 2, 0) ** 0.5, "kl": kl / n,
            "ref_true_reward": rr / n, "ref_true_reward_std": max(rr2 / n - (rr / n) ** 2, 0) ** 0.5,
            "win_rate": wins / n, "n_completions": int(n), "samples": samples}


def print_samples(result, log):
    """A few prompts with π_ref's and the policy's completions and their true rewards."""
    for s in result["samples"]:
        log(f"prompt: {s['prompt']!r}\n  π_ref  ({s['ref_reward']:+.2f}): {s['ref']!r}\n"
            f"  policy ({s['policy_reward']:+.2f}): {s['policy']!r}")


@dataclass
class Config:
    policy: str = "out/dpo/model.safetensors"  # the policy to evaluate
    ref: str = "out/sft/model.safetensors"  # π_ref; its folder holds tokenizer.json
    prompts: str = "out/task/prompts_eval.jsonl"  # held-out prompts, JSONL {"prompt": ...}
    k: int = 4  # completions per prompt from each model
    seed: int = 0  # sampling seed (each rank adds its rank)
    out: str = ""  # write the result as JSON here ("" = print only)


def main(cfg):
    d = init_distributed()
    for path in (cfg.policy, cfg.ref, cfg.prompts):
        if not os.path.exists(path):
            raise SystemExit(f"error: {path} does not exist")
    tok = data.load_tokenizer(os.path.join(os.path.dirname(cfg.ref), "tokenizer.json"))
    policy, _ = load_model(cfg.policy, d.device)
    ref, _ = load_model(cfg.ref, d.device)
    res = evaluate_policy(policy, ref, tok, data.read_prompts(cfg.prompts), d, k=cfg.k, seed=cfg.seed)
    if d.is_main:
        print_samples(res, print)
        print(" | ".join(f"{k} {v:.4f}" for k, v in res.items() if isinstance(v, float)))
        if cfg.out:
            atomic_write_json(cfg.out, res)
    teardown(d)


if __name__ == "__main__":
    main(parse_config(Config, doc=__doc__))
