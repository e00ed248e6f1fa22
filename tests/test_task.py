"""The built-in task: built the same for a seed and refused for another, its closed forms (the
hidden reward on hand examples, exact text probabilities that sum to one, an entropy floor no model
beats), its tokenizer, and the regimes, which change what the pairs show and leave π_ref's texts as
they were.

    pytest tests/test_task.py
"""
import hashlib
import itertools
import json
import math
import os
import re
import statistics
import subprocess
import sys

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import data
import task as tasks  # the built-in task (`task` is a fixture's name in the suite)
from plumbing import init_distributed
from tests.helpers import DEFAULT_SHA256, ROOT


# ==================================================================================================
# the tokenizer and the task (data.py, task.py)
# ==================================================================================================

def test_tokenizer_round_trip_and_specials(tmp_path):
    texts = ["the movie is great .", "i hated the plot .", "Ünïcode ✓,  two spaces\tand a tab\n"]
    tok = data.train_tokenizer(texts * 20, vocab_size=300)
    assert tok.pad != tok.eos and tok.vocab_size == tok.tk.get_vocab_size(with_added_tokens=True)
    for t in texts + ["unseen: xyz 123 {}", ""]:
        assert tok.decode(tok.encode(t)) == t  # byte-level: any string round-trips
    assert (tok.decode([tok.eos] + tok.encode("hi there") + [tok.eos, tok.pad, tok.pad])
            == "hi there")
    path = str(tmp_path / "tokenizer.json")
    data.save_tokenizer(tok, path)
    tok2 = data.load_tokenizer(path)
    assert (tok2.eos, tok2.pad, tok2.vocab_size) == (tok.eos, tok.pad, tok.vocab_size)
    assert tok2.encode(texts[2]) == tok.encode(texts[2])
    # A user tokenizer.json with EOS but no PAD (as GPT-2's) gets PAD as one more id.
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer, tk.decoder = (pre_tokenizers.ByteLevel(add_prefix_space=False),
                                    decoders.ByteLevel())
    tk.train_from_iterator(
        texts * 20, trainers.BpeTrainer(vocab_size=280, special_tokens=[data.EOS],
                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    n = tk.get_vocab_size()
    tk.save(str(tmp_path / "user.json"))
    user = data.load_tokenizer(str(tmp_path / "user.json"))
    assert user.eos == tk.token_to_id(data.EOS) and user.pad == n and user.vocab_size == n + 1
    assert user.decode([user.eos] + user.encode("the plot") + [user.pad]) == "the plot"
    # Without EOS there is no BOS/EOS to use: an error that says so.
    tk = Tokenizer(models.BPE())
    tk.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=100))
    tk.save(str(tmp_path / "noeos.json"))
    with pytest.raises(SystemExit, match="noeos.json: .*endoftext"):
        data.load_tokenizer(str(tmp_path / "noeos.json"))
    (tmp_path / "garbage.json").write_text("not json")
    with pytest.raises(SystemExit, match="garbage.json: not a tokenizer.json"):
        data.load_tokenizer(str(tmp_path / "garbage.json"))


def test_require_task_skips_an_optional_input_left_empty_and_names_a_missing_one(tmp_path):
    d, said = init_distributed(), []
    tasks.require_task({"": ""}, d, said.append)  # --val_prompts "": nothing built, nothing said
    assert said == []
    with pytest.raises(SystemExit, match="does not exist"):  # --test_prompts "" is no such file
        tasks.require_task({"": "out/task/prompts_test.jsonl"}, d, said.append)
    with pytest.raises(SystemExit, match="nope.jsonl does not exist"):
        tasks.require_task({str(tmp_path / "nope.jsonl"): ""}, d, said.append)
    assert said == []


TASK_FILES = ["pairs_train.jsonl", "pairs_val.jsonl", "prompts_test.jsonl", "prompts_train.jsonl",
              "prompts_val.jsonl", "sft_train.txt", "sft_val.txt", "task.json", "tokenizer.json"]


def test_build_task_deterministic_and_schema(task, tmp_path):
    again = str(tmp_path / "again")
    tasks.build_task(again, seed=0)
    assert sorted(os.listdir(task)) == sorted(os.listdir(again)) == TASK_FILES  # no temp dirs left
    for name in TASK_FILES:
        with open(os.path.join(task, name), "rb") as f, open(os.path.join(again, name), "rb") as g:
            assert f.read() == g.read(), name
    assert not [p for p in os.listdir(tmp_path) if p != "again"]
    logs = []  # present: not rebuilt; another seed in the same folder is an error
    assert tasks.ensure_task(task, seed=0, log=logs.append) == task and logs == []
    with pytest.raises(ValueError, match="seed"):
        tasks.ensure_task(task, seed=1)
    with open(os.path.join(task, "task.json")) as f:
        meta = json.load(f)
    assert meta["counts"] == tasks.SIZES and meta["seed"] == 0
    with open(os.path.join(task, "pairs_train.jsonl")) as f:
        assert all(list(json.loads(line)) == ["prompt", "chosen", "rejected"] for line in f)
    pairs = data.read_pairs(os.path.join(task, "pairs_train.jsonl"))
    assert len(pairs) == meta["counts"]["pairs_train"]
    for r in pairs:  # a prompt and either response make a text of the language
        assert (r["chosen"].startswith(" ") and r["rejected"].startswith(" ")
                and r["chosen"] != r["rejected"])
        assert text_ok(r["prompt"] + r["chosen"]) and text_ok(r["prompt"] + r["rejected"])
    # Bradley-Terry labels: noisy, but chosen usually has the higher hidden reward
    rc = [tasks.true_reward(r["prompt"], r["chosen"]) for r in pairs]
    rr = [tasks.true_reward(r["prompt"], r["rejected"]) for r in pairs]
    assert 0.7 < sum(a > b for a, b in zip(rc, rr)) / len(pairs) < 0.95
    held_out = {}
    for split in ("val", "test"):  # two held-out sets, disjoint: selection never sees a test prompt
        held_out[split] = data.read_prompts(os.path.join(task, f"prompts_{split}.jsonl"))
        assert len(held_out[split]) == meta["counts"][f"prompts_{split}"] == 200
        assert all(p.endswith(" .") and text_ok(f"{p} {p}") for p in held_out[split])
    assert not set(held_out["val"]) & set(held_out["test"])
    assert len(set(held_out["val"])) > 150  # redrawn, not emptied of variety
    texts = data.read_texts(os.path.join(task, "sft_val.txt"))
    assert len(texts) == meta["counts"]["sft_val"] and all(map(text_ok, texts))


def text_ok(t):
    return math.isfinite(tasks.text_logprob(t))


def test_task_floor(task, tok):
    with open(os.path.join(task, "task.json")) as f:
        meta = json.load(f)
    floor = meta["floor_nats_per_token"]
    assert meta["vocab_size"] == tok.vocab_size
    assert math.isfinite(floor) and 0 < floor < math.log(tok.vocab_size)
    # The floor is an entropy: no model beats it, e.g. a unigram model fitted on the val
    # texts themselves.
    counts = {}
    val = data.read_texts(os.path.join(task, "sft_val.txt"))
    for t in val:
        for i in tok.encode(t) + [tok.eos]:
            counts[i] = counts.get(i, 0) + 1
    n = sum(counts.values())
    assert floor < -sum(c * math.log(c / n) for c in counts.values()) / n


def test_true_reward_hand_examples():
    # the prompt does not count
    assert tasks.true_reward("it felt awful .", " the movie is great .") == 2.0
    assert tasks.true_reward("", " i hated the plot . it felt fine .") == -2.0 + 0.5
    assert tasks.true_reward("", " the cast was good and good . we saw it on monday .") == 2.0
    # junk earns the malformed-sentence penalty, not its words; so does no sentence at all
    assert tasks.true_reward("", "GREAT,superb!! xyz greatgreat <|endoftext|>") == -1.0
    assert tasks.true_reward("", "") == -1.0


def test_text_logprob_hand_worked():
    # "it felt {adj} ." then "we saw it on {day} .", then stop: templates 1/5 each, "great" is
    # positive (prob p) and one of 8, the day one of 5, stop after the 2nd sentence P_STOP; p
    # uniform on 5 values.
    mean_p = sum(tasks.P_VALUES) / 5
    want = (1 / 5) * (mean_p / 8) * (1 / 5) * (1 / 5) * 0.35
    assert math.isclose(tasks.text_logprob("it felt great . we saw it on monday ."), math.log(want))
    # 2 positive slots (great, loved) and 2 negative (awful, weak): E_p[p^2 (1-p)^2]; 3 sentences:
    # continue after the 2nd (1 - P_STOP), stop after the 3rd.
    m = sum(p ** 2 * (1 - p) ** 2 for p in tasks.P_VALUES) / 5
    want = ((1 / 5) * (1 / 8) * (1 / 8) * (1 / 8)   # "the {noun} was {adj} and {adj} ."
            * (1 / 5) * (1 / 3) * (1 / 8)           # "i {verb} the {noun} ."
            * (1 / 5) * (1 / 8)                     # "it felt {adj} ."
            * 0.65 * 0.35 * m)
    got = tasks.text_logprob("the movie was great and awful . i loved the plot . it felt weak .")
    assert math.isclose(got, math.log(want))
    for bad in ["the movie is great .", "the movie is great",
                "the movie is amazing . it felt good .",
                "the movie is great .  it felt good .", "it felt great . it felt good . ",
                "i felt good . it felt good ."]:
        assert tasks.text_logprob(bad) == -math.inf, bad


def sentences(templates):
    """Every sentence the given templates can make."""
    out = []
    for t in templates:
        slots = [tasks.NEUTRAL[w] if w in tasks.NEUTRAL else
                 sum(tasks.SENTIMENT[w], []) if w in tasks.SENTIMENT else [w] for w in t.split()]
        out += [" ".join(ws) for ws in itertools.product(*slots)]
    return out


def test_text_logprob_sums_to_one():
    # Summing the exact probability over whole sets of texts: any unnormalized factor (a slot's word
    # choice, the latent p, the templates, the length) shows up as a wrong total.
    everything, last = sentences(tasks.TEMPLATES), sentences(["it felt {adj} ."])
    assert len(everything) == len(set(everything)) == 8 * 16 + 8 * 16 * 16 + 6 * 8 + 16 + 5
    total = sum(math.exp(tasks.text_logprob(a + " " + b)) for a in everything for b in last)
    assert math.isclose(total, 0.35 * (1 / 5), rel_tol=1e-9)  # P(2 sentences) * P(2nd is "it felt")
    short = sentences(["it felt {adj} .", "we saw it on {day} ."])
    total = sum(math.exp(tasks.text_logprob(" ".join(s)))
                for s in itertools.product(short, repeat=3))
    assert math.isclose(total, 0.65 * 0.35 * (2 / 5) ** 3, rel_tol=1e-9)


# ==================================================================================================
# regimes of the task
# ==================================================================================================

@pytest.fixture(scope="module")
def regimes(task, tmp_path_factory):
    """{regime: folder} for seed 0; the default is the module's `task`."""
    root = tmp_path_factory.mktemp("regimes")
    out = {"default": task}
    for regime in ("capped", "unseen", "shifted"):
        out[regime] = tasks.ensure_task(str(root / regime), seed=0, regime=regime,
                                        log=lambda *a: None)
    return out


def task_meta(folder):
    with open(os.path.join(folder, "task.json")) as f:
        return json.load(f)


def responses(folder, split="pairs_train"):
    return [(r["prompt"], r[k]) for r in data.read_pairs(os.path.join(folder, f"{split}.jsonl"))
            for k in ("chosen", "rejected")]


def test_default_regime_is_the_task_as_it_was(regimes):
    for name, want in DEFAULT_SHA256.items():
        with open(os.path.join(regimes["default"], name), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == want, name
    meta = task_meta(regimes["default"])
    want = ("default", list(tasks.P_VALUES), None)
    assert (meta["regime"], meta["p_values"], meta["cap"]) == want
    pool = data.read_pairs(f"{regimes['default']}/pairs_train.jsonl")
    assert meta["pool_best"] == tasks.pool_best(pool)


def test_capped_pool_holds_nothing_above_the_cap(regimes):
    cap, default, capped = tasks.CAP, regimes["default"], regimes["capped"]
    meta = task_meta(capped)
    assert (meta["regime"], meta["cap"], meta["pool_best"]) == ("capped", cap, cap)
    # the stated cap is the median true reward of the generator's responses (the default pool's)
    assert statistics.median(tasks.true_reward(p, y) for p, y in responses(default)) == cap
    for split in ("pairs_train", "pairs_val"):
        got = responses(capped, split)
        assert max(tasks.true_reward(p, y) for p, y in got) <= cap  # the pool never shows more
        assert all(text_ok(p + y) for p, y in got)  # the generator's responses, only fewer of them
        # the same prompts in the same order, and a pair that was under the cap anyway is unchanged:
        # only the responses above the cap were redrawn
        old = data.read_pairs(os.path.join(default, f"{split}.jsonl"))
        new = data.read_pairs(os.path.join(capped, f"{split}.jsonl"))
        assert [r["prompt"] for r in old] == [r["prompt"] for r in new]
        under = [o == n for o, n in zip(old, new)
                 if max(tasks.true_reward(o["prompt"], o[k])
                        for k in ("chosen", "rejected")) <= cap]
        assert len(under) > len(old) / 4 and all(under)
    # everything else is the default's, byte for byte: the same π_ref serves both regimes
    for name in TASK_FILES:
        if not name.startswith(("pairs", "task")):
            with open(os.path.join(default, name), "rb") as f:
                assert f.read() == open(os.path.join(capped, name), "rb").read(), name


def test_unseen_pool_holds_no_top_word_while_pi_refs_texts_do(regimes):
    default, unseen = regimes["default"], regimes["unseen"]
    assert tasks.TOP_WORDS == {"great", "superb", "loved"}  # the words of weight 2.0
    meta = task_meta(unseen)
    assert (meta["regime"], meta["cap"], meta["top_words"]) == ("unseen", None,
                                                               ["great", "loved", "superb"])
    pool = responses(unseen) + responses(unseen, "pairs_val")
    assert not any(tasks.has_top_word(y) for _, y in pool)  # the labels never show them
    assert meta["pool_top_word_rate"] == 0 and all(text_ok(p + y) for p, y in pool)
    assert all(pool[i] != pool[i + 1] for i in range(0, len(pool), 2))  # each pair's two differ
    # in the default pool they appear: more than 1 response in 10 was redrawn
    old = responses(default) + responses(default, "pairs_val")
    rate = tasks.top_word_rate([y for _, y in old])
    assert rate > 0.1 and rate == task_meta(default)["pool_top_word_rate"]
    # the prompts keep theirs: the rule is on responses, and the prompts are the default's
    assert [p for p, _ in pool] == [p for p, _ in old]
    assert any(tasks.has_top_word(p) for p, _ in old)
    # the texts, the prompts and the tokenizer are the default's, byte for byte: the same π_ref
    for name in TASK_FILES:
        if not name.startswith(("pairs", "task")):
            with open(os.path.join(default, name), "rb") as f:
                assert f.read() == open(os.path.join(unseen, name), "rb").read(), name
    # and π_ref's texts hold top words at the generator's rate. Closed form: a sentence lacks them
    # with probability q(p), its templates' mean of prod over slots (1 - p * top share), the share
    # 2 of 8 positive adjectives and 1 of 3 positive verbs; a text of n sentences q(p)^n
    q = lambda p: ((1 - p / 4) + (1 - p / 4) ** 2 + (1 - p / 3) + (1 - p / 4) + 1) / 5  # noqa: E731
    p_n = {n: (tasks.P_STOP if n < tasks.MAX_SENTENCES else 1) * (1 - tasks.P_STOP) ** (n - 2)
           for n in range(2, tasks.MAX_SENTENCES + 1)}
    want = 1 - statistics.mean(sum(w * q(p) ** n for n, w in p_n.items()) for p in tasks.P_VALUES)
    texts = data.read_texts(os.path.join(unseen, "sft_train.txt"))
    got = tasks.top_word_rate(texts)
    assert got == meta["sft_top_word_rate"] and round(want, 3) == 0.362
    # 4 standard errors of a share of 20,000 texts: fails by chance with probability < 1e-4
    assert abs(got - want) <= 4 * math.sqrt(want * (1 - want) / len(texts))


def test_a_redraw_touches_only_the_responses_its_rule_rejects(regimes):
    # unseen and capped redraw by rejection from a stream of their own: a response the rule keeps
    # is the default's, byte for byte, in the same pair (a pair whose two it keeps is unchanged,
    # label and all), and the other pairs come out as they would have without the redraws
    rules = {"unseen": lambda p, y: tasks.has_top_word(y),
             "capped": lambda p, y: tasks.true_reward(p, y) > tasks.CAP}
    for regime, rejected in rules.items():
        for split in ("pairs_train", "pairs_val"):
            old = data.read_pairs(os.path.join(regimes["default"], f"{split}.jsonl"))
            new = data.read_pairs(os.path.join(regimes[regime], f"{split}.jsonl"))
            assert len(old) == len(new) and [o["prompt"] for o in old] == [n["prompt"] for n in new]
            n_kept = n_same = 0
            for o, n in zip(old, new):
                kept = [o[k] for k in ("chosen", "rejected") if not rejected(o["prompt"], o[k])]
                n_kept += len(kept)
                assert set(kept) <= {n["chosen"], n["rejected"]}, (regime, o, n)
                if len(kept) == 2:
                    n_same += 1
                    assert o == n, (regime, o, n)
            assert n_kept > len(old) and n_same > len(old) / 4, regime


def test_top_word_rate_by_hand():
    # a share of texts holding at least one top word as a whole word, in any case: "greatly" and
    # "lovedthe" are other words; several top words in one text count it once
    texts = [" the movie is great .", " it felt greatly good .", " i lovedthe plot .",
             "GREAT,superb!! i LOVED it", " we saw it on monday .", ""]
    assert [tasks.has_top_word(t) for t in texts] == [True, False, False, True, False, False]
    assert tasks.top_word_rate(texts) == 2 / 6
    assert tasks.top_word_rate([" i loved the plot . it felt superb ."]) == 1.0
    # the top words are those of the highest weight, and every other word of the reward is not
    assert [w for w in tasks.WEIGHTS if tasks.has_top_word(w)] == ["great", "superb", "loved"]
    with pytest.raises(SystemExit, match="'unseeen' is not a regime of the task"):
        tasks.check_regime("unseeen")


def test_shifted_generator_puts_pi_refs_mode_below_the_default(regimes):
    meta = task_meta(regimes["shifted"])
    assert (meta["regime"], meta["p_values"]) == ("shifted", list(tasks.SHIFTED_P_VALUES))
    # π_ref imitates the generator's texts (sft.py gets within ~0.03 nats of its floor), so their
    # mean true reward is π_ref's. Closed form: a sentence's expected reward given the latent p is
    # (2p - 1) times the mean weight of its slots' words, 1.25 per adjective and 1.5 per verb, over
    # the templates' 4 adjectives and 1 verb in 5; times the expected number of sentences.
    e_n = sum(n * (tasks.P_STOP if 2 <= n < tasks.MAX_SENTENCES else 1)
              * (1 - tasks.P_STOP) ** (n - 2)
              for n in range(2, tasks.MAX_SENTENCES + 1))
    mean = {}
    for regime in ("default", "shifted"):
        pv = tasks.SHIFTED_P_VALUES if regime == "shifted" else tasks.P_VALUES
        want = (2 * sum(pv) / len(pv) - 1) * (4 * 1.25 + 1.5) / 5 * e_n
        r = [tasks.true_reward("", t) for t in data.read_texts(f"{regimes[regime]}/sft_val.txt")]
        mean[regime] = statistics.mean(r)
        # 4 standard errors of the mean of 1000 texts: fails by chance with probability < 1e-4
        assert abs(mean[regime] - want) <= 4 * statistics.stdev(r) / math.sqrt(len(r)), regime
    assert mean["shifted"] < mean["default"] - 2
    # the pairs come from that same generator: their responses are as negative as π_ref's
    pool = {k: statistics.mean(tasks.true_reward(p, y) for p, y in responses(regimes[k]))
            for k in ("default", "shifted")}
    assert pool["shifted"] < pool["default"] - 1
    # the floor in task.json is the shifted generator's entropy: its texts are in the language and
    # their exact probability is computed with the shifted p values
    texts = data.read_texts(f"{regimes['shifted']}/sft_val.txt")
    assert all(math.isfinite(tasks.text_logprob(t, tasks.SHIFTED_P_VALUES)) for t in texts)
    tok = data.load_tokenizer(f"{regimes['shifted']}/tokenizer.json")
    n_tok = sum(len(tok.encode(t)) + 1 for t in texts)
    floor = -sum(tasks.text_logprob(t, tasks.SHIFTED_P_VALUES) for t in texts) / n_tok
    assert meta["floor_nats_per_token"] == pytest.approx(floor, rel=1e-12)


def test_regimes_deterministic_and_a_bad_regime_is_a_clear_error(regimes, tmp_path):
    again = str(tmp_path / "again")
    tasks.build_task(again, seed=0, regime="capped")
    for name in TASK_FILES:
        with open(os.path.join(regimes["capped"], name), "rb") as f:
            assert f.read() == open(os.path.join(again, name), "rb").read(), name
    with pytest.raises(ValueError, match="regime capped, not seed 0 and regime shifted"):
        tasks.ensure_task(again, seed=0, regime="shifted")
    says = ("error: --regime 'nope' is not a regime of the task: choose one of default, capped, "
            "unseen, shifted")
    with pytest.raises(SystemExit, match=re.escape(says)):
        tasks.ensure_task(str(tmp_path / "nope"), regime="nope")
    assert not os.path.exists(tmp_path / "nope")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "task.py"), "--regime", "nope",
                        "--out_dir", str(tmp_path / "nope")], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 1 and p.stderr.strip() == says and not os.path.exists(tmp_path / "nope")


def test_pool_best_and_the_fraction_beyond_it():
    rows = [{"prompt": "it felt great .", "chosen": " i loved the plot . it felt fine .",
             "rejected": " it felt bad ."},
            {"prompt": "x", "chosen": " it felt good .", "rejected": " it felt awful ."}]
    assert tasks.pool_best(rows) == 2.5  # loved + fine; the prompt's "great" does not count
    assert tasks.fraction_beyond([2.5, 3.0, -1.0, 4.0], 2.5) == 0.5  # strictly beyond: 3 and 4


def test_pool_best_and_p99_read_both_responses_even_where_the_best_is_rejected(tmp_path):
    # the labels need not follow the hidden reward (Bradley-Terry draws), so the pool's best may be
    # a rejected response: here " i loved the plot . it felt great ." = loved 2 + great 2 = 4,
    # while the chosen ones score good 1 and bad −1 (the rejected other: awful −2)
    rows = [{"prompt": "it felt good .", "chosen": " it felt good .",
             "rejected": " i loved the plot . it felt great ."},
            {"prompt": "it felt good .", "chosen": " it felt bad .",
             "rejected": " it felt awful ."}]
    assert tasks.pool_best(rows) == 4.0
    # rewards sorted −2, −1, 1, 4; numpy's linear interpolation at 0.99 × 3 = 2.97: 1 + 0.97 × 3
    assert tasks.pool_quantile(rows, 0.99) == pytest.approx(3.91, abs=1e-12)
    folder = tmp_path / "t"
    folder.mkdir()
    (folder / "pairs_train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "task.json").write_text("{}")
    marks = tasks.task_pool_marks(str(folder / "prompts_test.jsonl"))
    assert marks == {"pool_best": 4.0, "pool_p99": pytest.approx(3.91, abs=1e-12)}
    assert tasks.task_pool_best(str(folder / "prompts_test.jsonl")) == 4.0
