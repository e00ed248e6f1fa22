"""The three services DPO deletes from PPO's job, each a class a loop builds in load_models and
calls in its phases: the rollout engine (an inference copy of the policy that samples with the KV
cache), the reward service (r_φ or the hidden reward, and the missing-EOS rule) and the weight sync
(the trainer's weights to the engine after every update). ppo.py, grpo.py and online_dpo.py hold
all three; dpo.py holds none: its job is one model and a file."""
import copy
import itertools
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from model import IGNORE, generate, score_at_last
from plumbing import SEED_STRIDE, all_reduce_sum, autocast, clock, gathered, precision
from task import bradley_terry, true_reward


class RolloutEngine:
    """The inference copy of the policy, all bf16 under bf16 autocast (as vLLM serves it), refreshed
    by WeightSync after every update. It samples; it never trains."""

    def __init__(self, policy, d):
        bf16 = precision(d.device) == "bf16"
        self.model = copy.deepcopy(policy).to(torch.bfloat16 if bf16 else torch.float32)
        self.model.eval().requires_grad_(False)
        self.d = d

    def sample(self, prompts, batch, idx, it, seed, tok, per_prompt=1, temperature=1.0):
        """per_prompt completions of each prompt of this rank's share idx of the global batch, with
        the KV cache, rows [this rank's prompts] x per_prompt. Completion k of global row j draws
        its tokens from row k·R + j of uniforms seeded by (seed, iteration), within the global
        batch's token budget: the same samples on any world size. Returns generate()'s dict plus
        P (generate left-pads the prompts to P columns), the response columns resp and rmask
        (rows, N), and full (rows, L), the targets: column c - 1 predicts the token at column c."""
        d, B = self.d, len(idx)
        rng = torch.Generator().manual_seed(seed + SEED_STRIDE * it + 1)  # +1: not the update's
        n_new = self.model.config.block_size - max(len(prompts[i]) for i in batch)
        U = torch.rand(per_prompt, len(batch), n_new,
                       generator=rng)[:, d.rank * B:(d.rank + 1) * B].flatten(0, 1)
        out = generate(self.model, [prompts[i] for i in idx] * per_prompt, n_new, tok.eos, tok.pad,
                       temperature=temperature, uniforms=U.to(d.device))
        P = max(len(prompts[i]) for i in idx)
        resp, rmask = out["tokens"][:, P:], out["response_mask"][:, P:]
        full = F.pad(resp.masked_fill(~rmask, IGNORE), (P - 1, 1), value=IGNORE)
        return {**out, "P": P, "resp": resp, "rmask": rmask, "full": full}

    def load_weights(self, flat):
        """Unpack one flat buffer, in parameters() order (a tied weight once), into the copy."""
        dst = list(self.model.parameters())
        with torch.no_grad():
            for p, chunk in zip(dst, flat.split([p.numel() for p in dst])):
                p.copy_(chunk.view_as(p))


def replies(tok, ro):
    """The sampled responses as text, each cut at its EOS."""
    return [tok.decode(y[m].tolist()) for y, m in zip(ro["resp"], ro["rmask"])]


def oracle_scores(true, u, group_size):
    """--reward oracle: each completion's share of Bradley-Terry wins against the others of its
    group, drawn with the built-in task's labeller (task.bradley_terry) on the hidden reward. true
    (R,) the hidden reward, u (R/G, G, G) uniforms: pair i < j of group g reads u[g, i, j]. A scalar
    a person's pairwise verdicts give, noisy as the offline pool's labels are."""
    G = group_size
    wins = torch.zeros(len(true), dtype=torch.float64)
    for g, (i, j) in itertools.product(range(len(true) // G), itertools.combinations(range(G), 2)):
        a, b = g * G + i, g * G + j
        wins[a if bradley_terry(float(u[g, i, j]), float(true[a]), float(true[b])) else b] += 1
    return (wins / (G - 1)).to(true.dtype)


class RewardService:
    """r_φ's score at each response's last token, or the hidden true reward when reward_model is
    None. A response without EOS (the block ran out) gets missing_eos_score instead,
    lm-human-preferences' rule (Huang et al. 2023, "The N Implementation Details of RLHF with PPO"):
    replaced, not lowered as TRL's missing_eos_penalty, since r_φ never saw an unfinished response
    and its score there means nothing, and a sum-of-words reward would still pay for rambling on."""

    def __init__(self, reward_model, missing_eos_score, tok, d):
        self.model, self.missing_eos_score = reward_model, missing_eos_score
        self.tok, self.d = tok, d

    def score(self, ro, texts):
        """ro: RolloutEngine.sample's dict, texts: each row's prompt. Returns (score (rows,),
        has_eos (rows,))."""
        tok, d = self.tok, self.d
        has_eos = ((ro["resp"] == tok.eos) & ro["rmask"]).any(1)
        if self.model is not None:
            with torch.no_grad(), autocast(d.device):
                raw = score_at_last(self.model(ro["tokens"], mask=ro["mask"]).float(), ro["mask"])
        else:
            raw = torch.tensor([true_reward(t, y) for t, y in zip(texts, replies(tok, ro))],
                               device=d.device)
        return torch.where(has_eos, raw, self.missing_eos_score), has_eos

    def score_groups(self, ro, texts, it, cfg):
        """GRPO's: score() on this rank's completions, all-reduced into the global batch's, since a
        group's baseline reads every member and any rank may hold part of a group. --reward oracle
        turns them into each completion's Bradley-Terry wins within its group (oracle_scores; the
        draws see missing_eos_score too). Returns (score (B,), has_eos (B,), scores (R,))."""
        d, B, R = self.d, len(texts), cfg.rollout_batch
        mine, has_eos = self.score(ro, texts)
        scores = torch.zeros(R, device=d.device)
        scores[d.rank * B:(d.rank + 1) * B] = mine
        scores = all_reduce_sum(scores, d)
        if cfg.reward == "oracle":  # +2: a stream of its own, the sampling's is +1
            rng = torch.Generator().manual_seed(cfg.seed + SEED_STRIDE * it + 2)
            u = torch.rand(R // cfg.group_size, cfg.group_size, cfg.group_size, generator=rng)
            scores = oracle_scores(scores.cpu(), u, cfg.group_size).to(d.device)
        return scores[d.rank * B:(d.rank + 1) * B], has_eos, scores


class WeightSync:
    """The trainer's weights to the rollout engine: rank 0 packs its parameters into one flat
    buffer in the engine's dtype (bf16 on CUDA: half the bytes) and broadcasts it; every rank loads
    it into its engine. DDP keeps every rank's trainer identical already, so this traffic stands for
    the real thing: a separate inference server (vLLM in OpenRLHF or TRL) is refreshed so after
    every update. With --fsdp every rank first all-gathers the whole fp32 weights (4 bytes per
    parameter, (world - 1) / world of them received; at 7B on 8 ranks 24.5 GiB per rank, on top of
    12.2 GiB broadcast in bf16)."""

    def __init__(self, d):
        self.d = d

    def push(self, trainer, engine):
        """Returns (bytes per receiving rank, seconds)."""
        d, t0 = self.d, time.perf_counter()
        dst = list(engine.model.parameters())  # parameters() yields a tied weight once, in order
        sizes = [p.numel() for p in dst]
        with gathered(trainer):
            if d.rank == 0:
                flat = torch.cat([p.detach().reshape(-1).to(dst[0].dtype)
                                  for p in trainer.parameters()])
            else:
                flat = torch.empty(sum(sizes), dtype=dst[0].dtype, device=d.device)
        if d.world > 1:
            dist.broadcast(flat, src=0)
        engine.load_weights(flat)
        return flat.numel() * flat.element_size(), clock(d) - t0
