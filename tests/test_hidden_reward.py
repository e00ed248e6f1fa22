"""The hidden reward is gated by the task's language, and every evaluation reports what it needs to
be read: the share of completions in the language and r_φ's score beside the true reward. Expected
values are worked out here by hand, never by calling the code under test.

    pytest tests/test_hidden_reward.py
"""
import hashlib
import json
import random
from types import SimpleNamespace

import pytest
import torch

import data
import evaluate
import task as tasks  # the built-in task (as test_all.py names it)
from model import GPT, GPTConfig, save_model
from plumbing import init_distributed
from study import compare, tables
from tests.helpers import DEFAULT_SHA256, constant_gpt  # fixtures come through conftest.py

PENALTY = -1.0  # what the task's docs promise a malformed sentence earns (MALFORMED_SCORE)
WEIGHT = {"great": 2.0, "superb": 2.0, "lovely": 1.5, "fun": 1.5, "good": 1.0, "nice": 1.0,
          "fine": 0.5, "decent": 0.5, "awful": -2.0, "terrible": -2.0, "boring": -1.5,
          "dull": -1.5, "bad": -1.0, "weak": -1.0, "slow": -0.5, "odd": -0.5, "loved": 2.0,
          "enjoyed": 1.5, "liked": 1.0, "hated": -2.0, "disliked": -1.5, "endured": -1.0}


def word_sum(text):
    """The reward as it was before the language gated it: the plain sum of the word weights."""
    return sum(WEIGHT.get(w, 0.0) for w in text.split())


def test_the_penalty_and_weights_are_the_ones_written_here():
    assert tasks.MALFORMED_SCORE == PENALTY and tasks.WEIGHTS == WEIGHT


# ==================================================================================================
# the pair pools do not change: every response the generator writes is in the language
# ==================================================================================================

# sha256 of pairs_train.jsonl and pairs_val.jsonl for seed 0 in every regime, computed by main at
# 45a2fd7 with the reward that summed word weights, before the language gated it. The capped
# regime's rule and every Bradley-Terry label read the reward, so equal bytes mean equal labels.
POOL_SHA256 = {
    ("default", "pairs_train"): "98bf2c985e658a73365772141f201fabae2fdc6c1c4e665b893414f3472cc7fa",
    ("default", "pairs_val"): "ad740172d5e26f57e88b493cbecce69e0a39b1618930a94771bb82ac0862ff14",
    ("capped", "pairs_train"): "af327cb9ccacd201010fa4304f0e7a7825d6a23ba1c1bdd94bd8d8d48fb232ab",
    ("capped", "pairs_val"): "aa2c5be183b38f2db5fadb9796729214af33fce47bc7af586d3b8b7851f058c6",
    ("unseen", "pairs_train"): "e0bafe52b2f0af5c51bf22f0d204b7d1823a2cd91c9cad66a7dd691ac44fe93b",
    ("unseen", "pairs_val"): "76c52a9037d59dd8cb3acdfe083670828e8254ae745fc65b19be08d6c27a8c3e",
    ("shifted", "pairs_train"): "4aec2cfa4f997ecc718854916072718573d79defa5d48aef63d94020b02942a8",
    ("shifted", "pairs_val"): "5c4aae7602077fdb3f3a6ed88dacb705df8a975d735b67cd726b5d7bd79a2296",
}


def pool(regime, name, seed=0):
    """A pool's rows drawn from the streams build_task draws them from (the tokenizer, which only
    build_task's other files need, is not trained), and the bytes it writes of them."""
    p_values = tasks.SHIFTED_P_VALUES if regime == "shifted" else tasks.P_VALUES
    r, redraw = random.Random(f"{seed}/{name}"), random.Random(f"{seed}/{name}/{regime}")
    rows = [tasks.sample_pair(r, p_values, tasks.REJECT.get(regime), redraw)
            for _ in range(tasks.SIZES[name])]
    return rows, "".join(json.dumps(row) + "\n" for row in rows).encode()


def test_pools_and_their_labels_are_byte_identical_and_paid_their_word_sums():
    # the default pools' hashes are the files build_task writes (tests/test_task.py checks them)
    for name in ("pairs_train", "pairs_val"):
        assert POOL_SHA256["default", name] == DEFAULT_SHA256[f"{name}.jsonl"]
    for (regime, name), want in POOL_SHA256.items():
        rows, raw = pool(regime, name)
        assert hashlib.sha256(raw).hexdigest() == want, (regime, name)
        for r in rows:
            for y in (r["chosen"], r["rejected"]):
                assert tasks.true_reward(r["prompt"], y) == word_sum(y)
                assert tasks.in_language(r["prompt"], y)
    # the texts π_ref learns from: whole texts, no prompt, all paid in full
    rng = random.Random("0/sft_val")
    for t in (tasks.sample_text(rng) for _ in range(500)):
        assert tasks.true_reward("", t) == word_sum(t)


# ==================================================================================================
# hand-worked values: what is malformed earns PENALTY a sentence, never its words
# ==================================================================================================

def test_hand_worked_rewards():
    r = tasks.true_reward
    one, two = "it felt awful .", "it felt fine . we saw it on monday ."  # 1 and 2 sentences
    # valid sentences earn their words; the prompt's words do not count
    assert r(one, " the movie is great .") == 2.0
    assert r(one, " the cast was good and good . we saw it on monday .") == 2.0
    # word salad: no template starts with "great"; junk without a period is one sentence
    assert r(one, " great superb loved great .") == PENALTY
    assert r(one, " GREAT,superb!! xyz greatgreat <|endoftext|>") == PENALTY
    assert r(one, " great great great great great great great great great") == PENALTY
    # adjectives chained past the template's two: the whole sentence earns the penalty
    assert r(one, " the ending was great and great and great .") == PENALTY
    assert r(one, " the ending was great and superb . it felt great and great .") == 4.0 + PENALTY
    assert r(one, " the movie is great great .") == PENALTY
    # no sentence at all: the text ends at the prompt, a text of its own from two sentences on
    # (the generator stops there as anywhere): nothing earned, nothing charged; after one, the
    # penalty
    assert r(one, "") == PENALTY and not tasks.in_language(one, "")
    assert r(two, "") == 0.0 and tasks.in_language(two, "")
    assert r(two, " ") == PENALTY and not tasks.in_language(two, " ")
    # a word of the wrong slot: a verb for an adjective, an adjective for a verb, a noun for a day
    assert r(one, " the movie is loved .") == PENALTY
    assert r(one, " i great the plot .") == PENALTY
    assert r(one, " we saw it on movie . it felt good .") == PENALTY + 1.0
    # a missing period, a trailing space, a doubled space, a capital, a word glued to the prompt's
    assert r(one, " it felt great . the movie is great") == 2.0 + PENALTY
    assert r(one, " it felt great . ") == 2.0 + PENALTY
    assert r(one, "  it felt great .") == PENALTY
    assert r(one, " It felt great .") == PENALTY
    assert r(one, "it felt great .") == PENALTY
    # a valid eight-sentence review (1 + 7): 4 − 2 − 1.5 + 0 + 0.5 + 1.5 + (−0.5 + 1.5) = 3.5
    seven = (" the plot was great and superb . i hated the ending . it felt dull . we saw it on "
             "friday . the cast is fine . i enjoyed the music . the script was odd and lovely .")
    assert r("i loved the movie .", seven) == 3.5
    assert tasks.in_language("i loved the movie .", seven)
    # ... the same seven after two prompt sentences: the ninth in all earns the penalty instead of
    # its +1 (the others: 3.5 − 1.0 = 2.5)
    assert r(two, seven) == 2.5 + PENALTY
    assert not tasks.in_language(two, seven)
    assert r(two, " it felt great ." * 6) == 12.0  # sentences 3 to 8
    assert r(two, " it felt great ." * 7) == 12.0 + PENALTY  # and a ninth
    assert r(two, " it felt great ." * 9) == 12.0 + 3 * PENALTY
    # with no prompt, the response is the whole text: eight sentences and no more
    assert r("", seven[1:] + " it felt good .") == 4.5
    assert r("", seven[1:] + " it felt good . it felt good .") == 4.5 + PENALTY


def test_malformed_completions_never_beat_the_generators_mean():
    """π_ref imitates the generator, whose mean reward is about 0 (the default pool's responses
    here); a completion made only of malformed sentences scores PENALTY per sentence, below it."""
    rows, _ = pool("default", "pairs_val")
    ys = [(r["prompt"], r[k]) for r in rows for k in ("chosen", "rejected")]
    mean = sum(word_sum(y) for _, y in ys) / len(ys)
    assert abs(mean) < 0.2
    rng = random.Random(0)
    for p, y in ys[:300]:
        # every sentence chained one adjective too far: no template has room for it
        chained = y.replace(" .", f" and {rng.choice(list(WEIGHT)[:8])} .")
        n = y.count(" .")
        assert tasks.true_reward(p, chained) == n * PENALTY < mean
        assert not tasks.in_language(p, chained)
        # the sentences without their periods: one run of words, one malformed sentence
        assert tasks.true_reward(p, y.replace(" .", "")) == PENALTY < mean


def test_a_response_is_charged_nothing_exactly_where_text_logprob_accepts_it():
    """in_language reads text_logprob; the reward must charge the penalty on exactly the
    completions it rejects. Each pool response, broken in one sentence or not at all: the broken
    sentence's words are replaced by the penalty, the others still earn theirs."""
    rows, _ = pool("default", "pairs_train")
    rng = random.Random(1)
    breaks = [lambda s: s[:-1] + ["and", "good", "."],       # a third adjective chained
              lambda s: s[:-1],                               # the period dropped (at the end)
              lambda s: s[:1] + s,                            # the first word repeated
              lambda s: ["the", "movie", "is", "loved", "."],  # a verb in an adjective's slot
              lambda s: s + ["it", "felt", "good", "."]]       # a ninth sentence (see below)
    for r in rows[:800]:
        p, y = r["prompt"], r["chosen"]
        sents = [s.split() + ["."] for s in y[1:].split(" .")[:-1]]
        kind = rng.randrange(len(breaks) + 1)
        if kind == len(breaks):
            assert tasks.in_language(p, y) and tasks.true_reward(p, y) == word_sum(y)
            continue
        if kind == 4:  # pad to eight sentences in all, then one more
            n_prompt = p.count(" .")
            sents += [["we", "saw", "it", "on", "friday", "."]] * (8 - n_prompt - len(sents))
            i, bad = len(sents) - 1, sents[-1] + ["it", "felt", "good", "."]
            want = sum(word_sum(" ".join(s)) for s in sents) + PENALTY
        else:
            i = rng.randrange(len(sents)) if kind != 1 else len(sents) - 1
            bad = breaks[kind](sents[i])
            want = sum(word_sum(" ".join(s)) for j, s in enumerate(sents) if j != i) + PENALTY
        broken = " " + " ".join(" ".join(s) for s in sents[:i] + [bad] + sents[i + 1:])
        assert not tasks.in_language(p, broken), broken
        assert tasks.true_reward(p, broken) == want, (p, broken)


# ==================================================================================================
# what every evaluation reports: in_language, reward_model_score, beyond_pool
# ==================================================================================================

def constant_reward_model(vocab_size, c):
    """A scalar-head GPT that reads every sequence as c: ln_f's gain and the head's weights are 0,
    so every position's output is the head's bias."""
    m = GPT(GPTConfig(block_size=64, vocab_size=vocab_size, n_layer=1, n_head=1, n_embd=4,
                      head="scalar"))
    with torch.no_grad():
        m.transformer.ln_f.weight.zero_()
        m.score.weight.zero_()
        m.score.bias.fill_(c)
    return m


def scripted_generate(script):
    """A stand-in for model.generate that writes, for each model, its scripted responses (text,
    whether it ends with EOS) in row order; tok and the models come through the closure's caller."""
    def generate(m, prompts, n_new, eos, pad, temperature=1.0, uniforms=None):
        tok, responses = script[id(m)]
        ids = [tok.encode(y) + ([eos] if ends else []) for y, ends in responses[:len(prompts)]]
        P = max(map(len, prompts))
        L = P + max(map(len, ids))
        tokens = torch.full((len(prompts), L), pad, dtype=torch.long)
        mask = torch.zeros(len(prompts), L, dtype=torch.bool)
        response_mask = mask.clone()
        for b, (x, y) in enumerate(zip(prompts, ids)):
            tokens[b, P - len(x):P + len(y)] = torch.tensor(x + y)
            mask[b, P - len(x):P + len(y)] = True
            response_mask[b, P:P + len(y)] = True
        return {"tokens": tokens, "mask": mask, "response_mask": response_mask}
    return generate


def test_eval_reports_the_language_share_and_r_phi_score(tmp_path, monkeypatch):
    texts = [tasks.sample_text(random.Random(i)) for i in range(300)]
    tok = data.train_tokenizer(texts, vocab_size=300)
    folder = tmp_path / "task"
    folder.mkdir()
    # a task folder: its pool's best response is "it felt great ." (+2)
    (folder / "task.json").write_text("{}\n")
    (folder / "pairs_train.jsonl").write_text(json.dumps(
        {"prompt": "it felt good .", "chosen": " it felt great .", "rejected": " it felt bad ."})
        + "\n")
    prompts = ["it felt good .", "the movie is great . i loved the plot ."]
    (folder / "prompts_test.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n"
                                                       for p in prompts))
    policy, ref = (constant_gpt(tok.vocab_size, tok.eos) for _ in range(2))
    # rows: prompt 1 twice, prompt 2 twice (k = 2); missing_eos_score −3
    script = {id(policy): (tok, [(" the plot was great and great and great .", True),  # −1
                                 (" it felt great .", True),                            # +2, in
                                 (" it felt great .", False),                           # −3: cut
                                 (" it felt great . it felt superb .", True)]),         # +4, in
              # 3 × 0.5, and 0: the text ends at prompt 2, a text of two sentences (in)
              id(ref): (tok, [(" it felt fine .", True)] * 3 + [("", True)])}
    monkeypatch.setattr(evaluate, "generate", scripted_generate(script))
    rm_dir = tmp_path / "reward"
    rm_dir.mkdir()
    save_model(constant_reward_model(tok.vocab_size, 0.75), str(rm_dir / "model.safetensors"),
               {"stage": "test"})
    data.save_tokenizer(tok, str(rm_dir / "tokenizer.json"))
    cfg = SimpleNamespace(test_prompts=str(folder / "prompts_test.jsonl"), val_prompts="",
                          eval_k=2, reward_model=str(rm_dir / "model.safetensors"))
    ev = evaluate.evaluate_held_out(policy, ref, tok, cfg, init_distributed(),
                                    missing_eos_score=-3.0)
    assert ev["true_reward"] == (-1 + 2 - 3 + 4) / 4 and ev["ref_true_reward"] == 1.5 / 4
    assert (ev["in_language"], ev["ref_in_language"]) == (2 / 4, 4 / 4)
    # r_φ reads 0.75 everywhere; the completion cut at the budget scores −3, as PPO's rule
    assert ev["reward_model_score"] == (0.75 * 3 - 3) / 4 and ev["ref_reward_model_score"] == 0.75
    assert (ev["pool_best"], ev["beyond_pool"], ev["ref_beyond_pool"]) == (2.0, 1 / 4, 0.0)
    # the pool's two responses score −1 and +2: its 99th percentile −1 + 0.99 × 3 = 1.97, which
    # the policy's +2 and +4 pass (2 of 4) and none of π_ref's (+0.5, 0) does
    assert ev["pool_p99"] == pytest.approx(1.97)
    assert (ev["beyond_pool_p99"], ev["ref_beyond_pool_p99"]) == (2 / 4, 0.0)
    # no r_φ in the config (DPO's), or one that reads another tokenizer: no score, no error
    del cfg.reward_model
    assert "reward_model_score" not in evaluate.evaluate_held_out(policy, ref, tok, cfg,
                                                                  init_distributed())
    other = data.train_tokenizer(texts, vocab_size=280)
    data.save_tokenizer(other, str(rm_dir / "tokenizer.json"))
    cfg.reward_model = str(rm_dir / "model.safetensors")
    assert "reward_model_score" not in evaluate.evaluate_held_out(policy, ref, tok, cfg,
                                                                  init_distributed())


def test_compare_rows_and_tables_carry_the_language_share_and_r_phi_score():
    ev = dict(kl=1.0, true_reward=0.5, true_reward_std=2.0, n_completions=16, in_language=0.25,
              ref_in_language=0.75, reward_model_score=1.5, ref_reward_model_score=0.0)
    row = compare.ev_fields(ev)
    assert (row["in_language"], row["ref_in_language"]) == (0.25, 0.75)
    assert (row["reward_model_score"], row["ref_reward_model_score"]) == (1.5, 0.0)
    old = compare.ev_fields(dict(kl=1.0, true_reward=0.5, true_reward_std=2.0, n_completions=16))
    assert old["in_language"] is old["reward_model_score"] is old["ref_in_language"] is None
    curve = dict(row, run="x", method="PPO", step=10, responses=640, flops=1e9,
                 true_reward_se=0.1, eos_rate=1.0, response_len=9.0)
    md = tables.curves_markdown([curve, dict(curve, step=20, in_language=None,
                                             reward_model_score=None)],
                                SimpleNamespace(curve_points=2))
    head = next(x for x in md.splitlines() if x.startswith("| method"))
    cells = [c.strip() for c in head.split("|")]
    assert cells.index("in language") == cells.index("EOS rate") + 1
    assert cells.index("r_φ score") == cells.index("EOS rate") + 2
    assert "| 1.000 | 0.250 | +1.500 | 9.0 |" in md and "| 1.000 | – | – | 9.0 |" in md


def test_the_frontier_table_shows_both_beside_the_eos_rate():
    from test_studies import frontier_row
    ref = dict(frontier_row("π_ref", ("", ""), "", 0.0, 0.0, 0.0), beta="", kl_coef="", lr="",
               in_language=0.95, reward_model_score=0.0)
    old = [frontier_row("DPO", (0.1, 1e-3), s, 2.0, 2.0, 2.0, check=2.0) for s in (1, 2)]
    new = [dict(frontier_row("PPO", (0.1, 1e-4), s, 2.0, 1.0, 1.0, check=1.0), in_language=x,
                reward_model_score=y) for s, x, y in ((1, 0.5, 3.0), (2, 0.7, 5.0))]
    md = tables.frontier_markdown([ref] + old + new, compare.Config(match_kls="1", check_at=0.75))
    lines = md.splitlines()
    cells = [c.strip() for c in next(x for x in lines if x.startswith("| method")).split("|")]
    row = lambda key: [c.strip() for c in next(x for x in lines if key in x).split("|")]  # noqa
    at = cells.index("EOS rate")
    assert cells[at + 1:at + 3] == ["in language", "r_φ score"]
    # two seeds: 0.5, 0.7 (mean 0.6, s.e. 0.1) and 3, 5 (mean 4, s.e. 1); rows without them: –
    assert row("| PPO |")[at + 1:at + 3] == ["0.600 ± 0.100", "+4.000 ± 1.000"]
    assert row("| DPO |")[at + 1:at + 3] == ["–", "–"]
    assert row("| π_ref |")[at + 1:at + 3] == ["0.950", "+0.000"]
