# Tests of data.py (merged into test_all.py by the lead).
import itertools
import json
import math
import os

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import data

TASK_FILES = ["pairs_train.jsonl", "pairs_val.jsonl", "prompts_eval.jsonl", "prompts_train.jsonl",
              "sft_train.txt", "sft_val.txt", "task.json", "tokenizer.json"]

@pytest.fixture(scope="module")
def task(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("task") / "task")
    logs = []
    assert data.ensure_task(d, seed=0, log=logs.append) == d
    assert len(logs) == 1 and "built the task" in logs[0]
    return d

@pytest.fixture(scope="module")
def tok(task):
    return data.load_tokenizer(os.path.join(task, "tokenizer.json"))

def test_tokenizer_round_trip_and_specials(tmp_path):
    texts = ["the movie is great .", "i hated the plot .", "Ünïcode ✓,  two spaces\tand a tab\n"]
    tok = data.train_tokenizer(texts * 20, vocab_size=300)
    assert tok.pad != tok.eos and tok.vocab_size == tok.tk.get_vocab_size(with_added_tokens=True)
    for t in texts + ["unseen: xyz 123 {}", ""]:
        assert tok.decode(tok.encode(t)) == t  # byte-level: any string round-trips
    assert tok.decode([tok.eos] + tok.encode("hi there") + [tok.eos, tok.pad, tok.pad]) == "hi there"
    path = str(tmp_path / "tokenizer.json")
    data.save_tokenizer(tok, path)
    tok2 = data.load_tokenizer(path)
    assert (tok2.eos, tok2.pad, tok2.vocab_size) == (tok.eos, tok.pad, tok.vocab_size)
    assert tok2.encode(texts[2]) == tok.encode(texts[2])
    # A user tokenizer.json with EOS but no PAD (as GPT-2's) gets PAD as one more id.
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tk.train_from_iterator(texts * 20, trainers.BpeTrainer(vocab_size=280, special_tokens=[data.EOS],
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
    with pytest.raises(ValueError, match="endoftext"):
        data.load_tokenizer(str(tmp_path / "noeos.json"))

def test_build_task_deterministic_and_schema(task, tmp_path):
    again = str(tmp_path / "again")
    data.build_task(again, seed=0)
    assert sorted(os.listdir(task)) == sorted(os.listdir(again)) == TASK_FILES  # no temp dirs left
    for name in TASK_FILES:
        with open(os.path.join(task, name), "rb") as f, open(os.path.join(again, name), "rb") as g:
            assert f.read() == g.read(), name
    assert not [p for p in os.listdir(tmp_path) if p != "again"]
    logs = []  # present: not rebuilt; another seed in the same folder is an error
    assert data.ensure_task(task, seed=0, log=logs.append) == task and logs == []
    with pytest.raises(ValueError, match="seed"):
        data.ensure_task(task, seed=1)
    with open(os.path.join(task, "task.json")) as f:
        meta = json.load(f)
    assert meta["counts"] == data.SIZES and meta["seed"] == 0
    with open(os.path.join(task, "pairs_train.jsonl")) as f:
        assert all(list(json.loads(line)) == ["prompt", "chosen", "rejected"] for line in f)
    pairs = data.read_pairs(os.path.join(task, "pairs_train.jsonl"))
    assert len(pairs) == meta["counts"]["pairs_train"]
    for r in pairs:  # a prompt and either response make a text of the language
        assert r["chosen"].startswith(" ") and r["rejected"].startswith(" ") and r["chosen"] != r["rejected"]
        assert text_ok(r["prompt"] + r["chosen"]) and text_ok(r["prompt"] + r["rejected"])
    # Bradley-Terry labels: noisy, but chosen usually has the higher hidden reward
    rc = [data.true_reward(r["prompt"], r["chosen"]) for r in pairs]
    rr = [data.true_reward(r["prompt"], r["rejected"]) for r in pairs]
    assert 0.7 < sum(a > b for a, b in zip(rc, rr)) / len(pairs) < 0.95
    prompts = data.read_prompts(os.path.join(task, "prompts_eval.jsonl"))
    assert len(prompts) == meta["counts"]["prompts_eval"] and all(p.endswith(" .") for p in prompts)
    texts = data.read_texts(os.path.join(task, "sft_val.txt"))
    assert len(texts) == meta["counts"]["sft_val"] and all(map(text_ok, texts))

def text_ok(t):
    return math.isfinite(data.text_logprob(t))

def test_task_floor(task, tok):
    with open(os.path.join(task, "task.json")) as f:
        meta = json.load(f)
    floor = meta["floor_nats_per_token"]
    assert meta["vocab_size"] == tok.vocab_size
    assert math.isfinite(floor) and 0 < floor < math.log(tok.vocab_size)
    # The floor is an entropy: no model beats it, e.g. a unigram model fitted on the val texts themselves.
    counts = {}
    val = data.read_texts(os.path.join(task, "sft_val.txt"))
    for t in val:
        for i in tok.encode(t) + [tok.eos]:
            counts[i] = counts.get(i, 0) + 1
    n = sum(counts.values())
    assert floor < -sum(c * math.log(c / n) for c in counts.values()) / n

def test_true_reward_hand_examples():
    assert data.true_reward("it felt awful .", " the movie is great .") == 2.0  # the prompt does not count
    assert data.true_reward("", " i hated the plot . it felt fine .") == -2.0 + 0.5
    assert data.true_reward("", " the cast was good and good . we saw it on monday .") == 2.0
    assert data.true_reward("", "GREAT,superb!! xyz greatgreat <|endoftext|>") == 4.0  # junk scores its words
    assert data.true_reward("", "") == 0.0

def test_text_logprob_hand_worked():
    # "it felt {adj} ." then "we saw it on {day} .", then stop: templates 1/5 each, "great" is positive
    # (prob p) and one of 8, the day one of 5, stop after the 2nd sentence P_STOP; p uniform on 5 values.
    mean_p = sum(data.P_VALUES) / 5
    want = (1 / 5) * (mean_p / 8) * (1 / 5) * (1 / 5) * 0.35
    assert math.isclose(data.text_logprob("it felt great . we saw it on monday ."), math.log(want))
    # 2 positive slots (great, loved) and 2 negative (awful, weak): E_p[p^2 (1-p)^2]; 3 sentences:
    # continue after the 2nd (1 - P_STOP), stop after the 3rd.
    m = sum(p ** 2 * (1 - p) ** 2 for p in data.P_VALUES) / 5
    want = ((1 / 5) * (1 / 8) * (1 / 8) * (1 / 8)   # "the {noun} was {adj} and {adj} ."
            * (1 / 5) * (1 / 3) * (1 / 8)           # "i {verb} the {noun} ."
            * (1 / 5) * (1 / 8)                     # "it felt {adj} ."
            * 0.65 * 0.35 * m)
    got = data.text_logprob("the movie was great and awful . i loved the plot . it felt weak .")
    assert math.isclose(got, math.log(want))
    for bad in ["the movie is great .", "the movie is great", "the movie is amazing . it felt good .",
                "the movie is great .  it felt good .", "it felt great . it felt good . ", "i felt good . it felt good ."]:
        assert data.text_logprob(bad) == -math.inf, bad

def sentences(templates):
    """Every sentence the given templates can make."""
    out = []
    for t in templates:
        slots = [data.NEUTRAL[w] if w in data.NEUTRAL else
                 sum(data.SENTIMENT[w], []) if w in data.SENTIMENT else [w] for w in t.split()]
        out += [" ".join(ws) for ws in itertools.product(*slots)]
    return out

def test_text_logprob_sums_to_one():
    # Summing the exact probability over whole sets of texts: any unnormalized factor (a slot's word
    # choice, the latent p, the templates, the length) shows up as a wrong total.
    everything, last = sentences(data.TEMPLATES), sentences(["it felt {adj} ."])
    assert len(everything) == len(set(everything)) == 8 * 16 + 8 * 16 * 16 + 6 * 8 + 16 + 5
    total = sum(math.exp(data.text_logprob(a + " " + b)) for a in everything for b in last)
    assert math.isclose(total, 0.35 * (1 / 5), rel_tol=1e-9)  # P(2 sentences) * P(2nd is "it felt")
    short = sentences(["it felt {adj} .", "we saw it on {day} ."])
    total = sum(math.exp(data.text_logprob(" ".join(s))) for s in itertools.product(short, repeat=3))
    assert math.isclose(total, 0.65 * 0.35 * (2 / 5) ** 3, rel_tol=1e-9)

GOOD = '{"prompt": "the plot is", "chosen": " good .", "rejected": " bad ."}'

@pytest.mark.parametrize("bad, says", [
    ("not json", "not valid JSON"),
    ('["the plot", " good .", " bad ."]', "expected a JSON object, got an array"),
    ('{"prompt": "a", "chosen": " b"}', 'missing field "rejected"'),
    ('{"prompt": "a", "rejected": " b"}', 'missing field "chosen"'),
    ('{"prompt": null, "chosen": " b", "rejected": " c"}', 'field "prompt" must be a string, got null'),
    ('{"prompt": "a", "chosen": 3, "rejected": " c"}', 'field "chosen" must be a string, got a number'),
    ('{"prompt": "a", "chosen": " b", "rejected": ["c"]}', 'field "rejected" must be a string, got an array'),
    ('{"prompt": "a", "chosen": "", "rejected": " c"}', 'field "chosen" is empty'),
    ('{"prompt": "a", "chosen": " c", "rejected": ""}', 'field "rejected" is empty'),
    ('{"prompt": "a", "chosen": " b", "rejected": " b"}', '"chosen" and "rejected" are identical'),
    ('{"chosen": "x b", "rejected": "x b"}', '"chosen" and "rejected" are identical'),
    ('{"chosen": "great plot", "rejected": "good plot"}', 'no "prompt" field'),  # common prefix has no space
    ('{"chosen": " yes", "rejected": " no"}', 'no "prompt" field'),             # ... or only at the start
])
def test_read_pairs_bad_rows_name_file_and_line(tmp_path, bad, says):
    path = tmp_path / "pairs.jsonl"
    path.write_text(GOOD + "\n\n" + GOOD + "\n" + bad + "\n" + GOOD + "\n")  # the blank line 2 is no row
    with pytest.raises(data.DataError) as e:
        data.read_pairs(str(path))
    assert str(e.value).startswith(f"{path}:4: ") and says in str(e.value), str(e.value)

def test_read_files_other_errors(tmp_path):
    p = tmp_path / "bytes.jsonl"
    p.write_bytes(GOOD.encode() + b"\n" + b'{"prompt": "\xff"}\n')
    with pytest.raises(data.DataError, match=f"^{p}:2: not UTF-8"):
        data.read_pairs(str(p))
    for name, reader in [("e.jsonl", data.read_pairs), ("e.jsonl", data.read_prompts), ("e.txt", data.read_texts)]:
        (tmp_path / name).write_text("\n  \n")
        with pytest.raises(data.DataError, match="empty"):
            reader(str(tmp_path / name))
    p = tmp_path / "prompts.jsonl"
    p.write_text('{"prompt": "it felt"}\n{"text": "it felt"}\n')
    with pytest.raises(data.DataError, match=f'^{p}:2: missing field "prompt"'):
        data.read_prompts(str(p))
    p = tmp_path / "prompts.txt"
    p.write_text("it felt\n\n the plot is \r\n")
    assert data.read_prompts(str(p)) == ["it felt", " the plot is "]

def test_read_pairs_full_texts_variant(tmp_path):
    rows = [{"chosen": "Human: hi Assistant: hello there", "rejected": "Human: hi Assistant: go away"},
            {"chosen": "Q: x A: the cat .", "rejected": "Q: x A: the dog ."},   # a shared first word stays
            {"chosen": "a\n\nHuman: b", "rejected": "a\n\nHuman: c d"},
            {"chosen": "the plot is good", "rejected": "the plot is good and long", "id": 7},
            {"prompt": "p", "chosen": "x", "rejected": "y"}]                  # explicit prompt: as given
    path = tmp_path / "full.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert data.read_pairs(str(path)) == [
        dict(prompt="Human: hi Assistant:", chosen=" hello there", rejected=" go away"),
        dict(prompt="Q: x A: the", chosen=" cat .", rejected=" dog ."),
        dict(prompt="a\n\nHuman:", chosen=" b", rejected=" c d"),
        dict(prompt="the plot is", chosen=" good", rejected=" good and long"),
        dict(prompt="p", chosen="x", rejected="y")]

def test_tokenize_pairs_truncation_rule(tok):
    assert all(len(tok.encode(" " + w)) == 1 for w in "the movie is great . i loved plot it felt".split())
    prompt, short = "the movie is great .", " i loved the plot ."   # 6 tokens with BOS, 6 with EOS
    long = " it felt great . it felt great . it felt great ."          # 13 with EOS
    rows = [dict(prompt=prompt, chosen=short, rejected=long)]
    x, ys, yl = data.encode_prompt(tok, prompt), data.encode_response(tok, short), data.encode_response(tok, long)
    assert (len(x), len(ys), len(yl)) == (6, 6, 13) and x[0] == tok.eos and yl[-1] == tok.eos
    ex, st = data.tokenize_pairs(tok, rows, max_len=19, max_prompt_len=4)    # 6 + 13 fits
    assert ex == [dict(index=0, prompt=x, chosen=ys, rejected=yl)]
    assert st == dict(rows=1, truncated_prompt=0, truncated_response=0, unusable=0)
    # too long by 3: the prompt gives up 3 tokens (it may: max(16 - 13, 2) = 3 >= 2), keeping its BOS
    ex, st = data.tokenize_pairs(tok, rows, max_len=16, max_prompt_len=2)
    assert ex[0]["prompt"] == [tok.eos] + x[-2:] and ex[0]["rejected"] == yl and ex[0]["chosen"] == ys
    assert st == dict(rows=1, truncated_prompt=1, truncated_response=0, unusable=0)
    # max_prompt_len 5 stops the prompt at 5 tokens; the longer response is cut to 16 - 5 = 11 (no EOS)
    ex, st = data.tokenize_pairs(tok, rows, max_len=16, max_prompt_len=5)
    assert ex[0]["prompt"] == [tok.eos] + x[-4:] and ex[0]["rejected"] == yl[:11] and ex[0]["chosen"] == ys
    assert st == dict(rows=1, truncated_prompt=1, truncated_response=1, unusable=0)
    # a prompt already short enough is kept whole and the responses are cut
    ex, st = data.tokenize_pairs(tok, rows, max_len=12, max_prompt_len=8)
    assert ex[0]["prompt"] == x and ex[0]["rejected"] == yl[:6] and ex[0]["chosen"] == ys
    assert st == dict(rows=1, truncated_prompt=0, truncated_response=1, unusable=0)
    # responses that differ only past the cut become identical: unusable, left out, counted; the
    # other rows keep their original index
    same = dict(prompt=prompt, chosen=long + " the plot is great .", rejected=long + " it felt fine .")
    ex, st = data.tokenize_pairs(tok, [rows[0], same, rows[0]], max_len=16, max_prompt_len=5)
    assert [e["index"] for e in ex] == [0, 2]
    assert st == dict(rows=3, truncated_prompt=3, truncated_response=3, unusable=1)
    with pytest.raises(AssertionError, match="max_prompt_len"):
        data.tokenize_pairs(tok, rows, max_len=8, max_prompt_len=8)

def test_tokenize_texts(tok):
    texts = ["it felt great . it felt good .", "it felt great . it felt good . it felt fine ."]
    ex, st = data.tokenize_texts(tok, texts, max_len=10)
    assert st == dict(rows=2, truncated=1)
    assert ex[0] == dict(index=0, prompt=[tok.eos], response=tok.encode(texts[0]) + [tok.eos])
    assert ex[1]["response"] == tok.encode(texts[1])[:9]

def test_collate_pairs_layout(tok):
    rows = [dict(prompt="the movie is gre", chosen="at . it felt good .", rejected=" bad ."),  # cut mid-word
            dict(prompt="it felt good .", chosen=" i loved the plot . it felt great .", rejected=" the end ."),
            dict(prompt="we saw it", chosen=" on monday .", rejected=" on friday . it felt dull .")]
    ex, _ = data.tokenize_pairs(tok, rows, max_len=64, max_prompt_len=8)
    b = data.collate_pairs(ex, tok.pad)
    ids, tg = b["input_ids"], b["targets"]
    T = max(len(e["prompt"]) + len(e[k]) for e in ex for k in ("chosen", "rejected"))
    assert ids.shape == tg.shape == (6, T) and ids.dtype == tg.dtype == torch.long
    assert b["index"].tolist() == [0, 1, 2] and b["index"].dtype == torch.long
    for i, (r, k) in enumerate((r, k) for k in ("chosen", "rejected") for r in rows):  # [chosen; rejected]
        x, y = data.encode_prompt(tok, r["prompt"]), data.encode_response(tok, r[k])
        P, n = len(x), len(x) + len(y)
        assert ids[i, :P].tolist() == x and ids[i, P:n].tolist() == y    # the boundary is exact
        assert (ids[i, n:] == tok.pad).all()
        assert tg[i, P - 1:n - 1].tolist() == y                           # position t predicts token t+1
        assert (tg[i, :P - 1] == -100).all() and (tg[i, n - 1:] == -100).all()
    assert (tg[:, -1] == -100).all()
    hit = tg != -100
    assert (tg[:, :-1][hit[:, :-1]] == ids[:, 1:][hit[:, :-1]]).all()
    # tokenized apart: "gre" + "at" is not the " great" that tokenizing the joined text would give
    assert data.encode_response(tok, "at . it felt good .")[0] != tok.encode("the movie is great .")[3]
    assert tok.decode(ids[0].tolist()) == rows[0]["prompt"] + rows[0]["chosen"]

def test_sharding_same_global_batches_any_world_size():
    n, B, seed = 103, 8, 5
    per_epoch = n // B  # 12 steps; the tail of 7 is dropped
    for step in range(3 * per_epoch):
        g = data.global_batch(n, B, step, seed)
        assert len(set(g)) == B and all(0 <= i < n for i in g)
        assert g == data.global_batch(n, B, step, seed)
        assert data.rank_slice(g, 0, 1) == g
        halves = [data.rank_slice(g, r, 2) for r in range(2)]
        assert halves[0] + halves[1] == g and not set(halves[0]) & set(halves[1])
        quarters = [data.rank_slice(g, r, 4) for r in range(4)]
        assert sum(quarters, []) == g and all(len(q) == 2 for q in quarters)
    epoch = sum((data.global_batch(n, B, s, seed) for s in range(per_epoch)), [])
    assert len(set(epoch)) == per_epoch * B                      # an epoch sees each example once at most
    assert data.global_batch(n, B, per_epoch, seed) != data.global_batch(n, B, 0, seed)  # reshuffled
    with pytest.raises(AssertionError, match="divisible"):
        data.rank_slice(list(range(6)), 0, 4)
    with pytest.raises(AssertionError, match="larger"):
        data.global_batch(5, 8, 0, 0)
