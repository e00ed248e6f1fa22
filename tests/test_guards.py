"""Refusals and guards, pinned by numbers written here rather than derived from the code they
guard: a stale reference cache whose only change is the token ids, the flag bounds whose reason
plumbing.FLAG_RANGES's comment gives, iterative DPO's rounds each drawing their own random
numbers, and evaluate.py's output keeping the policy's top-word rate apart from π_ref's.

    pytest tests/test_guards.py
"""
import itertools
import os
from types import SimpleNamespace

import pytest
import torch

import data
import dpo
import evaluate
import iterative_dpo
import ppo
import precompute
import task as tasks  # the built-in task (as test_all.py names it)
from checkpoint import load_ref_logps
from plumbing import init_distributed, parse_config
from tests.helpers import CPU, constant_gpt  # its fixtures come through conftest.py

# ==================================================================================================
# the reference cache: refused when only the token ids changed (checkpoint.fingerprint)
# ==================================================================================================

def test_a_cache_is_refused_when_only_its_token_ids_changed(tiny):
    own = tiny.root / "guards-ids"
    os.makedirs(own)
    rows = open(f"{tiny.task}/pairs_val.jsonl").readlines()[:8]
    (own / "pairs.jsonl").write_text("".join(rows))
    pc = precompute.Config(out_dir=str(own / "cache"), ref_model=f"{tiny.sft}/model.safetensors",
                           train_pairs=str(own / "pairs.jsonl"), val_pairs=str(own / "pairs.jsonl"))
    precompute.main(pc)
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    examples, _ = data.tokenize_pairs(tok, data.read_pairs(pc.train_pairs), pc.max_len,
                                      pc.max_prompt_len)
    path, rebuild = f"{pc.out_dir}/train.safetensors", "python precompute.py ..."
    assert load_ref_logps(path, pc, "train", examples, CPU.device, rebuild).shape == (2, 8)
    # the same files, flags and weights; one response a token shorter, as a change to the
    # tokenizer's or the truncation's code would leave it: only the catch-all can see it
    examples[0] = {**examples[0], "chosen": examples[0]["chosen"][:-1]}
    with pytest.raises(SystemExit, match=r"stale, computed for other inputs: the token ids "
                                         r"\(tokenizer, truncation or data code\) "
                                         r"\([0-9a-f]{12} -> [0-9a-f]{12}\)\. Rebuild"):
        load_ref_logps(path, pc, "train", examples, CPU.device, rebuild)


# ==================================================================================================
# the flag bounds a comment explains, by hand (plumbing.FLAG_RANGES)
# ==================================================================================================

@pytest.mark.parametrize("cls, flag, refused, allowed", [
    (dpo.Config, "label_smoothing", "0.5", "0.49"),  # at 0.5 a label says nothing
    (dpo.Config, "beta", "0.0009", "0.001"),  # below, the gradient falls under AdamW's ε
    (ppo.Config, "temperature", "0.09", "0.1"),  # below, log softmax(z/T)'s gradient underflows
    (dpo.Config, "max_len", "2", "3"),  # BOS, one prompt token and one response token
])
def test_the_explained_bounds_refuse_just_outside_and_allow_the_bound(cls, flag, refused, allowed):
    with pytest.raises(SystemExit, match=f"--{flag} {refused} is outside its allowed values"):
        parse_config(cls, [f"--{flag}", refused])
    assert str(getattr(parse_config(cls, [f"--{flag}", allowed]), flag)) == allowed


# ==================================================================================================
# iterative DPO: each round its own prompt order, tokens and labels (iterative_dpo.sample_pairs)
# ==================================================================================================

SCRIPTED_POLICY = SimpleNamespace(config=SimpleNamespace(block_size=64))  # generate is scripted


def record_labels(monkeypatch, drawn):
    """task.bradley_terry as it is, each uniform it reads appended to drawn["labels"]."""
    label = tasks.bradley_terry
    monkeypatch.setattr(tasks, "bradley_terry",
                        lambda u, *a: drawn["labels"].append(u) or label(u, *a))


def test_iterative_rounds_draw_their_own_prompts_tokens_and_labels(tiny, monkeypatch):
    # a scripted sampler: every completion ends and differs; what each round drew is recorded
    drawn, n = {}, itertools.count()
    monkeypatch.setattr(iterative_dpo, "generate", lambda policy, rows, *a, uniforms: (
        drawn["uniforms"].append(uniforms.clone()) or [None] * len(rows)))
    monkeypatch.setattr(iterative_dpo, "score_completions", lambda out, prompts, *a: (
        drawn["prompts"].extend(prompts) or [f"the plot {next(n)}" for _ in prompts],
        torch.ones(len(prompts), dtype=torch.bool), None, None))
    record_labels(monkeypatch, drawn)
    cfg = iterative_dpo.Config(pairs=4, micro_batch_size=4, seed=7)
    policy = SCRIPTED_POLICY
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    # prompts of one length, so that every batch draws uniforms of one shape
    by_len = {}
    for p in data.read_prompts(f"{tiny.task}/prompts_train.jsonl"):
        by_len.setdefault(len(data.encode_prompt(tok, p)), []).append(p)
    prompts = max(by_len.values(), key=len)[:16]
    assert len(set(prompts)) == 16
    rounds = []
    for r in (0, 1, 0):
        drawn.update(uniforms=[], prompts=[], labels=[])
        pairs, counts = iterative_dpo.sample_pairs(policy, tok, prompts, r, cfg, CPU)
        assert len(pairs) == counts["labelled"] == len(drawn["labels"]) == 4
        rounds.append((torch.cat(drawn["uniforms"]), drawn["prompts"][::2], drawn["labels"]))
    (u1, order1, labels1), (u2, order2, labels2), (u1_again, order1_again, labels1_again) = rounds
    # a round is its seed's: the same again
    assert torch.equal(u1, u1_again) and order1 == order1_again and labels1 == labels1_again
    # round 2 is not round 1 replayed: other prompts first, other token draws, other label draws
    assert order1 != order2
    assert not (u1 == u2).any()
    assert set(labels1).isdisjoint(labels2)


def test_iterative_batches_of_a_round_draw_their_own_prompts_and_tokens(tiny, monkeypatch):
    # a scripted sampler, one generate call a batch of 4 prompts: batch 0's completions never end,
    # batch 1 ends those of its first two prompts, batch 2 all of them, so the round samples 3
    # batches for its 4 pairs; 16 distinct prompts, so each batch can take prompts of its own
    drawn = dict(uniforms=[], prompts=[], labels=[])
    monkeypatch.setattr(iterative_dpo, "generate", lambda policy, rows, *a, uniforms: (
        drawn["uniforms"].append(uniforms.clone()) or [len(drawn["uniforms"]) - 1] * len(rows)))
    monkeypatch.setattr(iterative_dpo, "score_completions", lambda out, prompts, *a: (
        drawn["prompts"].append(prompts[::2]) or [f"text {out[0]}.{i}" for i in range(8)],
        torch.tensor([[False] * 8, [True] * 4 + [False] * 4, [True] * 8][out[0]]), None, None))
    record_labels(monkeypatch, drawn)
    cfg = iterative_dpo.Config(pairs=4, micro_batch_size=8, seed=7)
    policy = SCRIPTED_POLICY
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    prompts = data.read_prompts(f"{tiny.task}/prompts_train.jsonl")[:16]
    assert len(set(prompts)) == 16
    pairs, counts = iterative_dpo.sample_pairs(policy, tok, prompts, 1, cfg, CPU)
    assert counts == dict(labelled=4, sampled=12, unfinished=6, empty=0, identical=0)
    (p0, p1, p2), (u0, u1, u2) = drawn["prompts"], drawn["uniforms"]
    # each batch the next 4 prompts of the round's order, not the first batch's again
    assert len(set(p0 + p1 + p2)) == 12
    assert [p["prompt"] for p in pairs] == p1[:2] + p2[:2]
    # each batch its own token uniforms, and none of them the labels' draws
    draws = [set(u.flatten().tolist()) for u in (u0, u1, u2)] + [set(drawn["labels"])]
    assert len(drawn["labels"]) == 4
    assert all(a.isdisjoint(b) for i, a in enumerate(draws) for b in draws[i + 1:])


# ==================================================================================================
# the evaluation keeps the policy's numbers and π_ref's apart (evaluate.evaluate_policy)
# ==================================================================================================

def test_top_word_rates_are_the_policys_and_the_references_own(tiny):
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    great = tok.encode(" great")
    assert len(great) == 1 and "great" in tasks.TOP_WORDS
    rambler = constant_gpt(tok.vocab_size, great[0])  # " great great ...": a top word every time
    quitter = constant_gpt(tok.vocab_size, tok.eos)  # EOS at once: an empty response, no top word
    prompts = ["it felt good .", "the movie is great . i loved the plot ."]
    for policy, ref, want in ((rambler, quitter, (1.0, 0.0)), (quitter, rambler, (0.0, 1.0))):
        res = evaluate.evaluate_policy(policy, ref, tok, prompts, init_distributed(), k=2)
        assert (res["top_word_rate"], res["ref_top_word_rate"]) == want
