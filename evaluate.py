"""The evaluation every policy gets, DPO's and PPO's alike: true reward against KL from π_ref.

    python evaluate.py --policy out/dpo/model.safetensors        # any saved policy, one process
    torchrun --nproc_per_node=8 evaluate.py --policy out/ppo/model.safetensors

For each held-out prompt, sample k completions from the policy and k from π_ref (temperature 1, so
the samples are the distributions the KL is about). One rule scores every completion, π_ref's,
DPO's and PPO's alike, the rule PPO trains with (ppo.py): a completion that never emitted EOS (the
block ran out) scores missing_eos_score, whatever its words; a finished one its hidden true reward.
Report, as in Figure 2 of the DPO paper:
  true_reward   mean score of the policy's completions by that rule (the hidden reward is the
                task's stand-in for a classifier)
  kl            KL(π‖π_ref) estimated by the mean over samples y ~ π of
                Σ_t log π(y_t|·) − log π_ref(y_t|·), summed over the response tokens with the same
                log-prob function training uses
  win_rate      P(score of π's completion > score of π_ref's, same prompt), ties count half
and what a reward that pays for words could hide: eos_rate (share of completions that emitted EOS),
response_len (mean tokens of a completion, EOS included), true_reward_finished (mean true reward of
the completions that emitted EOS; null if none did), in_language (share of completions that emitted
EOS and are texts of the task's language, task.in_language: the share the hidden reward pays in
full); with the built-in task's pool beside the prompts, beyond_pool and beyond_pool_p99 (shares
above the pool's best response and its 99th percentile: what the pairs never or rarely showed);
ref_* the same for π_ref. With r_φ (--reward_model; a loop's cfg.reward_model), also
reward_model_score: r_φ's mean score by the same rule, the proxy PPO and online DPO optimise, beside
the true reward, so that over-optimisation shows where it happens.
The hidden reward belongs to the built-in task: on prompts its generator cannot write (a user's
data), true_reward, win_rate and their ref_ twins are left out, `true_reward_omitted` says why, and
kl, eos_rate and response_len stay.
Any world size samples the same completions: completion j of the whole list draws its tokens from
row j of uniforms seeded by `seed` (model.generate), and every completion has the same budget.
"""
import itertools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import data
import task
from checkpoint import atomic_write_json, require_reward_model, tokenizer_beside
from model import IGNORE, generate, load_model, score_at_last, sequence_logprobs
from plumbing import SEED_STRIDE, gathered, init_distributed, parse_config, reduce_sums, teardown

# A completion that never emitted EOS (the block ran out) scores this, whatever its words: the rule
# PPO trains with (lm-human-preferences; "N details"), applied here to every model alike. -1 sits
# below π_ref's average completion, which r_φ's offset puts at 0.
MISSING_EOS_SCORE = -1.0


@torch.no_grad()
def completion_logps(model, out):
    """Summed log-probs (B,) of generate()'s response tokens under `model`: the logits at column t−1
    predict the token at column t, and only response tokens count."""
    targets = out["tokens"][:, 1:].masked_fill(~out["response_mask"][:, 1:], IGNORE)
    targets = F.pad(targets, (0, 1), value=IGNORE)  # (B, L): the last column predicts nothing
    return sequence_logprobs(model, out["tokens"], targets, mask=out["mask"]).sum(-1)


def score_completions(out, prompts, tok, hidden, missing_eos_score):
    """The one scoring rule of every evaluation, for generate()'s output `out` on `prompts`:
    (texts, ended (B,) bool, true reward r (B,), score (B,)). score is r where the completion
    emitted EOS, else missing_eos_score (PPO's rule, for every model); r is 0 when the prompts are
    not the task's (hidden False: its reward means nothing there)."""
    ended = ((out["tokens"] == tok.eos) & out["response_mask"]).any(1).cpu()
    texts = [tok.decode(t[m].tolist()) for t, m in zip(out["tokens"], out["response_mask"])]
    r = torch.tensor([task.true_reward(p, y) if hidden else 0.0 for p, y in zip(prompts, texts)],
                     dtype=torch.float64)
    return texts, ended, r, torch.where(ended, r, missing_eos_score)


def load_reward_model(path, tok, device):
    """r_φ from `path` for reward_model_score, or None where there is none to read: no path (DPO's
    runs), no such file (online DPO labelling by the true reward, r_φ never built), or an r_φ
    trained with another tokenizer than π_ref's (it would read the policy's ids as other words)."""
    beside = os.path.join(os.path.dirname(path), "tokenizer.json")
    if not (path and os.path.exists(path) and os.path.exists(beside)):
        return None
    if data.load_tokenizer(beside).tk.to_str() != tok.tk.to_str():
        return None
    return load_model(path, device, head="scalar")[0].eval()


@torch.no_grad()
def evaluate_policy(policy, ref, tok, prompts, d, k=4, batch_size=64, seed=0, n_samples=3,
                    missing_eos_score=MISSING_EOS_SCORE, pool_best=None, reward_model=None,
                    pool_p99=None):
    """Sample, score and compare on `prompts` (a list of strings), sharded over ranks. Returns the
    eval fields (docs/DESIGN.md, "Contracts between stages"); `samples` holds the first few prompts
    with both models' completions. pool_best (task.task_pool_marks): also the share of completions
    scored above it, "beyond_pool": behaviour the training pairs never showed
    (task.fraction_beyond); pool_p99 (the same): the share above the pool's 99th percentile,
    "beyond_pool_p99".
    reward_model (r_φ): also its mean score, "reward_model_score", by the missing-EOS rule."""
    was_training = policy.training
    policy.eval(), ref.eval()
    block = policy.config.block_size
    hidden = task.task_prompts(prompts)
    # a long prompt keeps its BOS and last block//2 - 1 tokens, leaving room for the completion
    rows = [(p, data.truncate_prompt(data.encode_prompt(tok, p), block // 2))
            for p in prompts for _ in range(k)]
    n_new = block - max(len(x) for _, x in rows)  # every completion's budget, in any batch
    # Separate streams: π_ref's samples depend only on the seed, so every policy is compared with
    # the same π_ref baseline; and they are independent of the policy's even when the two models
    # are equal. Row j of U: completion j's draws, on whichever rank and in whichever batch.
    U = [torch.rand(len(rows), n_new, generator=torch.Generator().manual_seed(s))
         for s in (seed, seed + SEED_STRIDE)]
    mine = list(range(d.rank, len(rows), d.world))
    sums, samples = {}, []
    # --fsdp: whole weights on every rank for sampling (ranks run unequal numbers of forwards)
    with gathered(policy):
        for i in range(0, len(mine), batch_size):
            j = mine[i:i + batch_size]
            chunk = [rows[a] for a in j]
            outs = [generate(m, [x for _, x in chunk], n_new, tok.eos, tok.pad, temperature=1.0,
                             uniforms=u[j].to(d.device)) for m, u in zip((policy, ref), U)]
            new = {"n": len(j), "kl": (completion_logps(policy, outs[0])
                                       - completion_logps(ref, outs[0])).double().sum()}
            sides = []
            for side, o in zip(("", "ref_"), outs):
                texts, ended, r, score = score_completions(o, [p for p, _ in chunk], tok, hidden,
                                                           missing_eos_score)
                if reward_model is not None:  # r_φ's reading at the last token, as PPO's
                    rm = score_at_last(reward_model(o["tokens"], mask=o["mask"]).double(),
                                       o["mask"]).cpu()
                    new[side + "rm"] = torch.where(ended, rm, missing_eos_score).sum()
                new |= {side + "eos": ended.sum(), side + "len": o["response_mask"].sum(),
                        side + "score": score.sum(), side + "score2": (score * score).sum(),
                        side + "finished": torch.where(ended, r, 0.0).sum(),
                        side + "top": float(sum(map(task.has_top_word, texts))),
                        side + "lang": float(sum(e and task.in_language(p, y) for (p, _), y, e
                                                 in zip(chunk, texts, ended.tolist()))),
                        **({side + "beyond": (score > pool_best).sum()} if pool_best is not None
                           else {}),
                        **({side + "p99": (score > pool_p99).sum()} if pool_p99 is not None
                           else {})}
                sides.append((texts, ended, score))
            (texts, ended, score), (ref_texts, ref_ended, ref_score) = sides
            new["wins"] = ((score > ref_score).double() + 0.5 * (score == ref_score).double()).sum()
            for key, v in new.items():
                sums[key] = sums.get(key, 0.0) + v
            samples += [{"prompt": p, "policy": y, "policy_finished": bool(e), "ref": y_ref,
                         "ref_finished": bool(e_ref),
                         **({"policy_reward": float(s), "ref_reward": float(s_ref)}
                            if hidden else {})}
                        for a, (p, _), y, e, s, y_ref, e_ref, s_ref
                        in zip(j, chunk, texts, ended, score, ref_texts, ref_ended, ref_score)
                        if a % k == 0][:n_samples - len(samples)]  # one completion of each prompt
    s = reduce_sums(d, **sums)
    policy.train(was_training)
    n = s["n"]
    def std(side):
        return max(s[side + "score2"] / n - (s[side + "score"] / n) ** 2, 0) ** 0.5

    def finished(side):  # mean true reward of the finished completions; None if none finished
        return s[side + "finished"] / s[side + "eos"] if s[side + "eos"] else None
    res = {"kl": s["kl"] / n}
    if hidden:
        res |= {"true_reward": s["score"] / n, "true_reward_std": std(""),
                "ref_true_reward": s["ref_score"] / n, "ref_true_reward_std": std("ref_"),
                "win_rate": s["wins"] / n, "true_reward_finished": finished(""),
                "ref_true_reward_finished": finished("ref_"),
                # how often the task's best words appear: what an exploring policy raises
                "top_word_rate": s["top"] / n, "ref_top_word_rate": s["ref_top"] / n,
                "in_language": s["lang"] / n, "ref_in_language": s["ref_lang"] / n}
        if pool_best is not None:
            res |= {"pool_best": pool_best, "beyond_pool": s["beyond"] / n,
                    "ref_beyond_pool": s["ref_beyond"] / n}
        if pool_p99 is not None:
            res |= {"pool_p99": pool_p99, "beyond_pool_p99": s["p99"] / n,
                    "ref_beyond_pool_p99": s["ref_p99"] / n}
    else:
        res["true_reward_omitted"] = ("the prompts are not the built-in task's (its generator "
                                      "cannot write them): its hidden reward means nothing there")
    if reward_model is not None:
        res |= {"reward_model_score": s["rm"] / n, "ref_reward_model_score": s["ref_rm"] / n}
    return {**res, "eos_rate": s["eos"] / n, "response_len": s["len"] / n,
            "ref_eos_rate": s["ref_eos"] / n, "ref_response_len": s["ref_len"] / n,
            "n_completions": int(n), "samples": samples}


def mixture_logp(logps, weights):
    """log mix(y) = logsumexp_i(log w_i + log π_i(y)) for the mixture that picks policy i with
    probability w_i, then samples the whole completion from it. logps (P, B): B completions'
    summed log-probs under each of P policies; weights (P,), summing to 1. Returns (B,)."""
    w = torch.as_tensor(weights, dtype=logps.dtype, device=logps.device)
    return torch.logsumexp(logps + w.log()[:, None], dim=0)


@torch.no_grad()
def evaluate_mixture(policies, weights, ref, tok, prompts, d, k=4, batch_size=64, seed=0,
                     missing_eos_score=MISSING_EOS_SCORE):
    """KL(mix‖π_ref) and true reward (the built-in task's prompts only) of the mixture that, for
    each completion, picks policy i with probability weights[i] and samples the whole completion
    from it; sharded over ranks as evaluate_policy. Why: a method's frontier is the upper concave
    envelope of its policies' (KL, reward) points, and this mixture is what backs a point on a
    chord: its reward is Σ_i w_i r_i, its KL on or below the chord, by the convexity of KL,
    KL(mix‖π_ref) = Σ_i w_i [KL(π_i‖π_ref) − KL(π_i‖mix)]. The estimate is the mean over its
    completions of log mix(y) − log π_ref(y), log mix from every policy's log-prob
    (mixture_logp); kl_std and true_reward_std are per completion, for standard errors."""
    assert len(policies) == len(weights) >= 2 and abs(sum(weights) - 1) < 1e-9, weights
    modes = [m.training for m in policies]
    for m in (*policies, ref):
        m.eval()
    block, hidden = policies[0].config.block_size, task.task_prompts(prompts)
    rows = [(p, data.truncate_prompt(data.encode_prompt(tok, p), block // 2))
            for p in prompts for _ in range(k)]
    n_new = block - max(len(x) for _, x in rows)
    # Row j of U: completion j's draws, as evaluate_policy's, whichever policy samples it; the
    # choice of policy draws from a stream of its own, independent of them and of π_ref's.
    U = torch.rand(len(rows), n_new, generator=torch.Generator().manual_seed(seed))
    pick = torch.multinomial(torch.tensor(weights, dtype=torch.float64), len(rows), True,
                             generator=torch.Generator().manual_seed(seed + 2 * SEED_STRIDE))
    mine = list(range(d.rank, len(rows), d.world))
    sums = dict.fromkeys(("n", "kl", "kl2", "score", "score2"), 0.0)
    with gathered(*policies):
        for i, (c, policy) in itertools.product(range(0, len(mine), batch_size),
                                                enumerate(policies)):
            j = [a for a in mine[i:i + batch_size] if pick[a] == c]  # the batch's rows for c
            if not j:
                continue
            o = generate(policy, [rows[a][1] for a in j], n_new, tok.eos, tok.pad,
                         temperature=1.0, uniforms=U[j].to(d.device))
            logps = torch.stack([completion_logps(m, o).double() for m in policies])  # (P, B)
            kl = mixture_logp(logps, weights) - completion_logps(ref, o).double()
            score = score_completions(o, [rows[a][0] for a in j], tok, hidden,
                                      missing_eos_score)[3]
            for key, v in (("n", len(j)), ("kl", kl.sum()), ("kl2", (kl * kl).sum()),
                           ("score", score.sum()), ("score2", (score * score).sum())):
                sums[key] += v
    s = reduce_sums(d, **sums)
    for m, mode in zip(policies, modes):
        m.train(mode)
    n = s["n"]
    def std(key):
        return max(s[key + "2"] / n - (s[key] / n) ** 2, 0) ** 0.5
    res = {"kl": s["kl"] / n, "kl_std": std("kl"), "n_completions": int(n), "weights": weights}
    if hidden:
        res |= {"true_reward": s["score"] / n, "true_reward_std": std("score")}
    return res


def evaluate_held_out(policy, ref, tok, cfg, d, **kw):
    """A stage's last evaluation: evaluate_policy on cfg.test_prompts, the numbers it reports, and,
    when cfg.val_prompts is given, on those too, kept under "val" (samples left out). A study
    chooses its settings by "val" and reports the rest, so nothing it reports was tuned on. A loop
    with an r_φ (cfg.reward_model: PPO's, online DPO's) has its completions scored by it too, read
    from the file in full precision, as the frozen copy the loop trains against may not be."""
    reward_model = load_reward_model(getattr(cfg, "reward_model", ""), tok, d.device)

    def on(path):
        return evaluate_policy(policy, ref, tok, data.read_prompts(path), d, k=cfg.eval_k,
                               reward_model=reward_model, **task.task_pool_marks(path), **kw)
    ev = on(cfg.test_prompts)
    if cfg.val_prompts:
        ev["val"] = {k: v for k, v in on(cfg.val_prompts).items() if k != "samples"}
    return ev


def summary(res):
    """The one line a stage prints about its evaluation; without the hidden reward, it says why."""
    eos = (f"EOS rate {res['eos_rate']:.2f} (π_ref {res['ref_eos_rate']:.2f}) | length "
           f"{res['response_len']:.1f} tokens (π_ref {res['ref_response_len']:.1f})")
    kl = f"KL(π‖π_ref) {res['kl']:.3f} nats"
    if "true_reward" not in res:
        return f"{kl} | {eos} | no true reward: {res['true_reward_omitted']}"
    return (f"true reward {res['true_reward']:+.3f} ± {res['true_reward_std']:.3f} (π_ref "
            f"{res['ref_true_reward']:+.3f} ± {res['ref_true_reward_std']:.3f}) | {kl} | win rate "
            f"{res['win_rate']:.3f} | {eos}")


def print_samples(result, log):
    """A few prompts with π_ref's and the policy's completions and their scores (if any)."""
    def tag(s, side):
        end = "" if s[side + "_finished"] else ", no EOS"
        return (f"({s[side + '_reward']:+.2f}{end})" if side + "_reward" in s
                else f"({end[2:] or 'ended'})")
    for s in result["samples"]:
        log(f"prompt: {s['prompt']!r}\n  π_ref  {tag(s, 'ref')}: {s['ref']!r}\n"
            f"  policy {tag(s, 'policy')}: {s['policy']!r}")


@dataclass
class Config:
    policy: str = "out/dpo/model.safetensors"  # the policy to evaluate
    ref: str = "out/sft/model.safetensors"  # π_ref; its folder holds tokenizer.json
    prompts: str = "out/task/prompts_test.jsonl"  # held-out prompts, JSONL {"prompt": ...}
    k: int = 4  # completions per prompt from each model
    seed: int = 0  # sampling seed (the same completions on any world size)
    missing_eos_score: float = MISSING_EOS_SCORE  # score of a completion without EOS (PPO's rule)
    reward_model: str = ""  # r_φ whose mean score of the completions is reported too ("": none)
    out: str = ""  # write the result as JSON here ("" = print only)


def main(cfg):
    d = init_distributed()
    for path in (cfg.policy, cfg.ref, cfg.prompts, cfg.reward_model):
        if path and not os.path.exists(path):
            raise SystemExit(f"error: {path} does not exist")
    tok_path = tokenizer_beside(cfg.ref, "--ref")
    if cfg.reward_model:  # asked for by name: a wrong one is an error, not a missing field
        require_reward_model(cfg.reward_model, "--reward_model", tok_path)
    tok = data.load_tokenizer(tok_path)
    policy, _ = load_model(cfg.policy, d.device)
    ref, _ = load_model(cfg.ref, d.device)
    res = evaluate_policy(policy, ref, tok, data.read_prompts(cfg.prompts), d, k=cfg.k,
                          seed=cfg.seed, missing_eos_score=cfg.missing_eos_score,
                          **task.task_pool_marks(cfg.prompts),
                          reward_model=load_reward_model(cfg.reward_model, tok, d.device))
    if d.is_main:
        print_samples(res, print)
        print(summary(res))
        if cfg.out:
            atomic_write_json(cfg.out, res)
    teardown(d)


if __name__ == "__main__":
    main(parse_config(Config, doc=__doc__))
