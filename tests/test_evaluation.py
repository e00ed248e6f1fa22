"""The evaluation (evaluate.py): π_ref against itself gives KL 0 and win rate 1/2, one scoring rule
for every model, the share of completions beyond the pool's best (and `python evaluate.py`'s
eval.json with both shares, counted from its samples), user prompts without the hidden
reward, and the KL estimate, a policy's and a mixture's (what backs a point on a frontier envelope),
against exact enumeration.

    pytest tests/test_evaluation.py
"""
import copy
import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import data
import evaluate
import ppo
import task as tasks  # the built-in task (`task` is a fixture's name in the suite)
from evaluate import evaluate_policy
from model import load_model
from plumbing import init_distributed
from tests.helpers import constant_gpt, tiny_gpt


# ==================================================================================================
# the evaluation: π_ref against itself gives KL 0 and win rate 1/2, one scoring rule for every
# model, the KL estimate against exact enumeration (evaluate.py)
# ==================================================================================================

def test_reference_against_itself_kl_zero_win_rate_half(tiny):
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    ref, ref2 = (load_model(f"{tiny.sft}/model.safetensors")[0] for _ in range(2))
    res = evaluate_policy(ref, ref2, tok, data.read_prompts(f"{tiny.task}/prompts_test.jsonl"),
                          init_distributed(), k=2)
    n = res["n_completions"]
    assert n == 400
    # the same weights score the same tokens with the same function: exactly
    assert res["kl"] == 0.0
    # Each comparison scores 1, 1/2 or 0 and, both sides sampling the same model independently, has
    # mean exactly 1/2 for every prompt; its variance is at most 1/4, so the mean of n lies within 4
    # standard errors, 4·(1/2)/√n = 0.1, except with probability < 1e-4.
    assert abs(res["win_rate"] - 0.5) <= 4 * 0.5 / math.sqrt(n)


def test_beyond_pool_is_the_share_of_completions_above_the_pools_best(tiny):
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    ref, ref2 = (load_model(f"{tiny.sft}/model.safetensors")[0] for _ in range(2))
    prompts = data.read_prompts(f"{tiny.task}/prompts_test.jsonl")[:40]
    path = f"{tiny.task}/prompts_test.jsonl"
    best = tasks.task_pool_best(path)  # the tiny task's folder holds task.json
    assert best == tasks.pool_best(data.read_pairs(f"{tiny.task}/pairs_train.jsonl"))
    assert tasks.task_pool_best(str(tiny.root / "elsewhere" / "p.jsonl")) is None
    # thresholds inside the rewards' range, so that the share is neither 0 nor 1 (the tiny π_ref
    # writes mostly junk, which the hidden reward charges per sentence: read its range first);
    # with k = 1 the samples hold every completion and its score: count them independently
    first = evaluate_policy(ref, ref2, tok, prompts, init_distributed(), k=1, n_samples=40)
    sides = [[s[f"{side}_reward"] for s in first["samples"]] for side in ("policy", "ref")]
    seen = sorted(set(sides[0] + sides[1]))
    inside = [t for t in ((a + b) / 2 for a, b in zip(seen, seen[1:]))
              if all(0 < tasks.fraction_beyond(r, t) < 1 for r in sides)]
    assert len(inside) >= 2, seen
    for t in (inside[0], inside[-1]):
        res = evaluate_policy(ref, ref2, tok, prompts, init_distributed(), k=1, n_samples=40,
                              pool_best=t)
        assert len(res["samples"]) == res["n_completions"] == 40
        for side in ("policy", "ref"):
            share = tasks.fraction_beyond([s[f"{side}_reward"] for s in res["samples"]], t)
            got = res["beyond_pool" if side == "policy" else "ref_beyond_pool"]
            assert 0 < share < 1 and got == pytest.approx(share, abs=1e-12), (t, side)
    assert "beyond_pool" not in evaluate_policy(ref, ref2, tok, prompts[:2], init_distributed(),
                                                k=1)


def worth(v):
    """A response of the task's language whose hidden reward is v (a multiple of 0.5, |v| <= 14):
    sentences "it felt great ." (+2) or "it felt awful ." (−2), then one adjective for the rest;
    "we saw it on monday ." (0) when nothing is left."""
    rest = {-1.5: "dull", -1.0: "bad", -0.5: "slow", 0.5: "fine", 1.0: "good", 1.5: "fun"}
    words = ["great"] * int(max(v, 0) // 2) + ["awful"] * int(max(-v, 0) // 2)
    words += [rest[v - 2 * len(words) * (1 if v > 0 else -1)]] if v % 2 else []
    return "".join(f" it felt {w} ." for w in words) or " we saw it on monday ."


def test_evaluate_main_reports_the_shares_beyond_the_pool_counted_from_its_samples(tiny, tmp_path):
    # `python evaluate.py` on 3 test prompts, k = 1: its 3 samples are every completion of each
    # model, with their scores, so the shares above the pool's marks can be counted from them
    folder, out = tmp_path / "task", tmp_path / "eval.json"
    folder.mkdir()
    (folder / "prompts_test.jsonl").write_text(
        "".join(open(f"{tiny.task}/prompts_test.jsonl").readlines()[:3]))
    model = f"{tiny.sft}/model.safetensors"
    cfg = evaluate.Config(policy=model, ref=model, prompts=str(folder / "prompts_test.jsonl"), k=1,
                          seed=1, out=str(out))
    evaluate.main(cfg)  # no task.json beside the prompts: no pool, no shares
    first = json.loads(out.read_text())
    assert not {"pool_best", "beyond_pool", "pool_p99", "beyond_pool_p99"} & first.keys()
    scores = {side: [s[f"{side}_reward"] for s in first["samples"]] for side in ("policy", "ref")}
    seen = sorted(set(scores["policy"] + scores["ref"]))
    assert len(first["samples"]) == 3 and len(seen) >= 2, scores
    # a pool whose best response scores m, the second highest score seen, and its three others
    # m − 3: the 99th percentile is m − 3 + 0.97 × 3 = m − 0.09 (numpy's linear interpolation at
    # 0.99 × 3 = 2.97), so a completion scoring m is above it but not above the best
    m = seen[-2]
    rows = [dict(prompt="it felt good .", chosen=worth(m), rejected=worth(m - 3)),
            dict(prompt="it felt good .", chosen=worth(m - 3),
                 rejected=worth(m - 3) + " we saw it on monday .")]  # the same reward, two texts
    assert [tasks.true_reward(r["prompt"], r[k]) for r in rows for k in ("chosen", "rejected")] \
        == [m, m - 3, m - 3, m - 3]
    (folder / "pairs_train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "task.json").write_text("{}")
    evaluate.main(cfg)
    ev = json.loads(out.read_text())
    assert ev["samples"] == first["samples"] and ev["n_completions"] == 3  # the same seed
    assert ev["pool_best"] == m and ev["pool_p99"] == pytest.approx(m - 0.09, abs=1e-9)
    for side, key in (("policy", ""), ("ref", "ref_")):
        assert ev[f"{key}beyond_pool"] == sum(s > m for s in scores[side]) / 3, side
        assert ev[f"{key}beyond_pool_p99"] == sum(s >= m for s in scores[side]) / 3, side
    # seen[-1] > m and m itself were scored: the two shares are not 0 and not equal
    both = [ev["beyond_pool"] + ev["ref_beyond_pool"], ev["beyond_pool_p99"]
            + ev["ref_beyond_pool_p99"]]
    assert 0 < both[0] < both[1]


def test_evaluation_scores_every_model_by_one_rule(tiny):
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    great = tok.encode(" great")
    assert len(great) == 1
    rambler = constant_gpt(tok.vocab_size, great[0])  # " great great ...": +2 a word, no EOS
    quitter = constant_gpt(tok.vocab_size, tok.eos)  # EOS at once: an empty, finished response
    prompts = ["it felt good .", "the movie is great . i loved the plot ."]
    N = 64 - len(data.encode_prompt(tok, prompts[1]))  # every completion's budget: the block's rest
    d = init_distributed()
    res = evaluate_policy(rambler, quitter, tok, prompts, d, k=2, missing_eos_score=-3.0)
    # the policy never ends: every completion scores missing_eos_score (its words would pay 2N)
    assert (res["true_reward"], res["true_reward_std"], res["eos_rate"]) == (-3.0, 0.0, 0.0)
    assert res["response_len"] == N and res["true_reward_finished"] is None
    # π_ref ends at once: finished, one token (the EOS), no sentence: the malformed penalty, -1,
    # after the one-sentence prompt; 0 after the two-sentence one, which is a text of its own
    assert (res["ref_true_reward"], res["ref_eos_rate"], res["ref_response_len"]) == (-0.5, 1, 1)
    assert res["ref_true_reward_finished"] == -0.5 and res["win_rate"] == 0.0  # -3 < -1, always
    # KL: every token is " great", N of them, log π(great) - log π_ref(great) each
    logits = lambda m: m.transformer.wte.weight[:, 0].detach()  # noqa: E731  (the constant logits)
    per_token = (F.log_softmax(logits(rambler), 0) - F.log_softmax(logits(quitter), 0))[great[0]]
    assert res["kl"] == pytest.approx(N * per_token.item(), rel=1e-12) and per_token > 30
    assert res["n_completions"] == 4 and res["samples"][0]["policy"] == " great" * N
    # the same model on both sides: every comparison a tie (-3 against -3), and a tie counts half
    res = evaluate_policy(rambler, copy.deepcopy(rambler), tok, prompts, d, k=2)
    assert res["win_rate"] == 0.5 and res["kl"] == 0.0
    assert res["true_reward"] == res["ref_true_reward"] == evaluate.MISSING_EOS_SCORE
    assert evaluate.MISSING_EOS_SCORE == ppo.Config.missing_eos_score  # DPO's eval = PPO's rule
    assert evaluate.summary(res).startswith("true reward -1.000")


def test_evaluation_on_user_prompts_omits_the_hidden_reward(tiny):
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    assert tasks.task_prompts(["it felt good .", "the movie is great . i loved the plot ."])
    for user in (["Human: hi there. Assistant:"], ["it felt good"], ["it felt amazing ."]):
        assert not tasks.task_prompts(user + ["it felt good ."])
    quitter = constant_gpt(tok.vocab_size, tok.eos)
    user = ["Human: hi there. Assistant:"]
    res = evaluate_policy(quitter, quitter, tok, user, init_distributed(), k=2)
    hidden = {"true_reward", "true_reward_std", "ref_true_reward", "ref_true_reward_std",
              "win_rate", "true_reward_finished", "ref_true_reward_finished"}
    assert not hidden & res.keys() and "built-in task" in res["true_reward_omitted"]
    assert (res["kl"], res["eos_rate"], res["response_len"], res["ref_eos_rate"]) == (0, 1, 1, 1)
    assert not any("reward" in k for s in res["samples"] for k in s)
    lines = []  # what a stage prints about it
    evaluate.print_samples(res, lines.append)
    lines.append(evaluate.summary(res))
    assert "no true reward: the prompts are not the built-in task's" in lines[-1]


def all_completions(n, V, eos):
    """Every response generate can return with a budget of n tokens over a vocab of V: each ends
    at its first EOS or after n tokens."""
    done, grow = [], [[]]
    while grow:
        y = grow.pop()
        if (y and y[-1] == eos) or len(y) == n:
            done.append(y)
        else:
            grow += [y + [v] for v in range(V)]
    return done


def test_evaluation_kl_against_exact_enumeration():
    V, eos, pad, prompt = 4, 0, 3, [0, 1, 2]  # BOS = EOS = 0, as data.encode_prompt
    policy, ref = (tiny_gpt(seed=s, vocab_size=V, block_size=6) for s in (3, 4))
    with torch.no_grad():  # larger logits: two clearly different distributions (KL 1.39 nats)
        for m in (policy, ref):
            m.transformer.wte.weight.mul_(8)
    ys = all_completions(6 - len(prompt), V, eos)
    assert len(ys) == 1 + 3 + 9 + 27
    L = len(prompt) + max(map(len, ys))
    out = {"tokens": torch.tensor([prompt + y + [pad] * (L - len(prompt) - len(y)) for y in ys]),
           "mask": torch.tensor([[c < len(prompt) + len(y) for c in range(L)] for y in ys])}
    out["response_mask"] = out["mask"].clone()
    out["response_mask"][:, :len(prompt)] = False
    lp, lq = evaluate.completion_logps(policy, out), evaluate.completion_logps(ref, out)
    for m, got in ((policy, lp), (ref, lq)):  # the obvious way: each prefix alone, token by token
        want = [sum(F.log_softmax(m(torch.tensor([prompt + y[:t]]))[0, -1], -1)[y[t]].item()
                    for t in range(len(y))) for y in ys]
        torch.testing.assert_close(got, torch.tensor(want, dtype=got.dtype), atol=1e-10, rtol=0)
    assert lp.exp().sum().item() == pytest.approx(1.0, abs=1e-12)  # a distribution over completions
    exact = (lp.exp() * (lp - lq)).sum().item()
    sd = (lp.exp() * (lp - lq - exact) ** 2).sum().item() ** 0.5
    # the evaluation's estimate, a mean over n sampled completions, lies within 5 standard errors
    # of the exact KL (a seeded draw: probability of failing < 1e-6); the exact KL is far above 5
    # standard errors, so a flipped sign, or another function's log-probs, would show
    n = 4000
    fake = SimpleNamespace(eos=eos, pad=pad, encode=lambda s: [int(w) for w in s.split()],
                           decode=lambda ids: " ".join(map(str, ids)))
    res = evaluate_policy(policy, ref, fake, ["1 2"], init_distributed(), k=n, batch_size=n)
    assert exact > 20 * sd / n ** 0.5 and abs(res["kl"] - exact) <= 5 * sd / n ** 0.5


# ==================================================================================================
# a mixture of policies: what backs a point on a method's frontier envelope (evaluate.py)
# ==================================================================================================

def favouring_gpt(token, V, nats, seed=3):
    """tiny_gpt(seed) whose next-token logits, at every position, are raised by `nats` for `token`:
    ln_f's bias gains b with wte·b = nats·e_token (wte has full row rank V <= n_embd)."""
    m = tiny_gpt(seed=seed, vocab_size=V, block_size=6)
    with torch.no_grad():
        m.transformer.wte.weight.mul_(8)  # larger logits, as test_evaluation_kl_against_exact_...
        m.transformer.ln_f.bias += torch.linalg.pinv(m.transformer.wte.weight) @ (
            nats * F.one_hot(torch.tensor(token), V).double())
    return m


def test_mixture_kl_against_exact_enumeration_below_the_chord():
    V, eos, pad, prompt, w = 4, 0, 3, [0, 1, 2], [0.3, 0.7]
    A, B = favouring_gpt(1, V, 4.0), favouring_gpt(2, V, 4.0)  # the same GPT, pulled two ways
    ref = favouring_gpt(0, V, 0.0, seed=4)
    ys = all_completions(6 - len(prompt), V, eos)
    L = len(prompt) + max(map(len, ys))
    out = {"tokens": torch.tensor([prompt + y + [pad] * (L - len(prompt) - len(y)) for y in ys]),
           "mask": torch.tensor([[c < len(prompt) + len(y) for c in range(L)] for y in ys])}
    out["response_mask"] = out["mask"].clone()
    out["response_mask"][:, :len(prompt)] = False
    la, lb, lq = (evaluate.completion_logps(m, out) for m in (A, B, ref))  # (40,) each, exact
    lm = evaluate.mixture_logp(torch.stack([la, lb]), w)
    # mix(y) = w_A A(y) + w_B B(y), in probability space: a distribution over the completions
    torch.testing.assert_close(lm.exp(), w[0] * la.exp() + w[1] * lb.exp(), atol=1e-14, rtol=0)
    assert lm.exp().sum().item() == pytest.approx(1.0, abs=1e-12)
    def kl(p, q):  # KL between two distributions over ys, given as log-probs
        return (p.exp() * (p - q)).sum().item()
    exact, chord = kl(lm, lq), w[0] * kl(la, lq) + w[1] * kl(lb, lq)
    # KL(mix‖ref) = Σ_i w_i [KL(π_i‖ref) − KL(π_i‖mix)], below the chord by Σ_i w_i KL(π_i‖mix)
    gap = w[0] * kl(la, lm) + w[1] * kl(lb, lm)
    assert exact == pytest.approx(chord - gap, abs=1e-12) and gap > 0.3  # measured 0.41 nats
    # evaluate_mixture's estimate, a mean over n completions, lies within 4 standard errors of
    # the exact KL; the chord lies 20 standard errors above it, so an estimate that scores a
    # completion only under the policy that sampled it (whose mean is the chord), or that drops
    # the log-weights (log mix + log(1/0.7) at least), fails
    sd = (lm.exp() * (lm - lq - exact) ** 2).sum().item() ** 0.5
    n = 4000
    se = sd / n ** 0.5
    fake = SimpleNamespace(eos=eos, pad=pad, encode=lambda s: [int(x) for x in s.split()],
                           decode=lambda ids: " ".join(map(str, ids)))
    res = evaluate.evaluate_mixture([A, B], w, ref, fake, ["1 2"], init_distributed(), k=n,
                                    batch_size=n)
    assert res["n_completions"] == n and res["weights"] == w
    assert chord - exact > 20 * se and abs(res["kl"] - exact) <= 4 * se, (res["kl"], exact, se)
    assert res["kl_std"] == pytest.approx(sd, rel=0.1)


def test_mixture_on_the_task_pays_the_weighted_reward_below_the_weighted_kl(tiny):
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    ref = load_model(f"{tiny.sft}/model.safetensors")[0]
    quitter = constant_gpt(tok.vocab_size, tok.eos)  # B: EOS at once, reward 0, KL −log π_ref(EOS)
    prompts = data.read_prompts(f"{tiny.task}/prompts_test.jsonl")[:100]
    d, w, kw = init_distributed(), [0.3, 0.7], {"k": 2, "missing_eos_score": -3.0}
    a, b = (evaluate_policy(m, ref, tok, prompts, d, **kw) for m in (ref, quitter))  # A = π_ref
    aa, bb = (evaluate.evaluate_mixture([m, m], [0.5, 0.5], ref, tok, prompts, d, **kw)
              for m in (ref, quitter))
    # a policy mixed with itself is that policy: completion j of either is drawn from row j of
    # the same uniforms, so both see the same completions and score them by one rule
    assert (aa["true_reward"], aa["true_reward_std"]) == (a["true_reward"], a["true_reward_std"])
    # (the KL to fp32 rounding: the mixture batches its rows by policy, so its batches differ)
    assert abs(aa["kl"]) <= 1e-6 and bb["kl"] == pytest.approx(b["kl"], rel=1e-6)
    mix = evaluate.evaluate_mixture([ref, quitter], w, ref, tok, prompts, d, **kw)
    n = mix["n_completions"]
    assert n == a["n_completions"] == 200 and a["kl"] == 0.0
    # Reward: completion j of the mixture is completion j of the chosen policy's evaluation, so
    # the gap to the chord's reward is the choice's noise alone, (1/n) Σ_j (1[j chose A] − w_A)
    # (s_A(j) − s_B(j)), variance w_A w_B E[(s_A − s_B)²] / n <= w_A w_B ((σ_A + σ_B)² + (r_A −
    # r_B)²) / n. A mixture that always chose A (r_A) lies 11 of these s.e. away (measured).
    rA, rB, sA, sB = a["true_reward"], b["true_reward"], a["true_reward_std"], b["true_reward_std"]
    se = (w[0] * w[1] * ((sA + sB) ** 2 + (rA - rB) ** 2) / n) ** 0.5
    assert rB - rA > 1.0  # measured: 0 against −1.6
    assert abs(mix["true_reward"] - (w[0] * rA + w[1] * rB)) <= 4 * se, (mix, rA, rB, se)
    # KL, one-sided: at most the chord's, w_A·0 + w_B·KL(B‖π_ref), within 4 s.e. of the difference
    # of the two estimates (the s.d. of a difference is at most the sum of the two s.d.)
    se = (mix["kl_std"] + w[1] * bb["kl_std"]) / n ** 0.5
    assert mix["kl"] <= w[1] * b["kl"] + 4 * se, (mix["kl"], b["kl"], se)
