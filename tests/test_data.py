"""Your data, read as TRL reads it: full texts with an implicit prompt, conversations through the
one chat template, the shipped example file and the own-data path end to end; and the rules that
turn rows into batches: truncation that keeps the prompt's BOS, one prompt rule for every stage that
samples, the [chosen; rejected] layout.

    pytest tests/test_data.py
"""
import json
import os
import random
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

import data
import dpo
import evaluate
import online_dpo
import plumbing
import ppo
import precompute
import reward
import sft
import task as tasks  # the built-in task (`task` is a fixture's name in the suite)
from evaluate import evaluate_policy
from model import GPT, GPTConfig, generate
from plumbing import init_distributed
from tests.helpers import CPU, EXAMPLE, ROOT, TINY_MODEL, constant_gpt, msgs, tiny_ppo_config


# ==================================================================================================
# formats: full texts, conversations, the example file, the own-data path (data.py)
# ==================================================================================================

def test_read_pairs_full_texts_variant(tmp_path):
    rows = [{"chosen": "Human: hi Assistant: hello there",
             "rejected": "Human: hi Assistant: go away"},
            # a shared first word stays
            {"chosen": "Q: x A: the cat .", "rejected": "Q: x A: the dog ."},
            {"chosen": "a\n\nHuman: b", "rejected": "a\n\nHuman: c d"},
            {"chosen": "the plot is good", "rejected": "the plot is good and long"},
            {"prompt": "p", "chosen": "x", "rejected": "y", "id": 7}]    # explicit prompt: as given
    path = tmp_path / "full.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert data.read_pairs(str(path)) == [
        dict(prompt="Human: hi Assistant:", chosen=" hello there", rejected=" go away"),
        dict(prompt="Q: x A: the", chosen=" cat .", rejected=" dog ."),
        dict(prompt="a\n\nHuman:", chosen=" b", rejected=" c d"),
        dict(prompt="the plot is", chosen=" good", rejected=" good and long"),
        dict(prompt="p", chosen="x", rejected="y")]


def test_read_pairs_conversational_rows_use_the_one_template(tmp_path):
    sys_u = msgs(("system", "Be brief."), ("user", "Rain today?"))
    abc = msgs(("user", "a"), ("assistant", "b"), ("user", "c"))
    rows = [dict(prompt=sys_u, chosen=msgs(("assistant", "No.")),
                 rejected=msgs(("assistant", "Yes."))),
            # implicit prompt: the messages both begin with; a response may go on for more turns
            dict(chosen=sys_u + msgs(("assistant", "No."), ("user", "Sure?"),
                                     ("assistant", "Yes.")),
                 rejected=sys_u + msgs(("assistant", "Maybe."))),
            dict(chosen=abc + msgs(("assistant", "d")), rejected=abc + msgs(("assistant", "e"))),
            dict(prompt="User: hi\nAssistant:", chosen=" hello", rejected=" go away"),  # strings
            # a prompt that ends with an assistant turn gets no "\nAssistant:" of its own: as TRL
            # (continue_final_message), each response follows it as the next message
            dict(prompt=abc[:2], chosen=msgs(("assistant", "c")),
                 rejected=msgs(("assistant", "d"))),
            dict(chosen=abc[:2] + msgs(("assistant", "c")),
                 rejected=abc[:2] + msgs(("assistant", "d")))]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    x = "System: Be brief.\nUser: Rain today?\nAssistant:"
    assert data.read_pairs(str(tmp_path / "c.jsonl")) == [
        dict(prompt=x, chosen=" No.", rejected=" Yes."),
        dict(prompt=x, chosen=" No.\nUser: Sure?\nAssistant: Yes.", rejected=" Maybe."),
        dict(prompt="User: a\nAssistant: b\nUser: c\nAssistant:", chosen=" d", rejected=" e"),
        dict(prompt="User: hi\nAssistant:", chosen=" hello", rejected=" go away"),
        *[dict(prompt="User: a\nAssistant: b", chosen="\nAssistant: c",
               rejected="\nAssistant: d")] * 2]
    # the same template renders SFT text ({"messages"} rows) and prompts: a pair's prompt + chosen
    # is the SFT text of the whole conversation, token for token (the boundary is at a word start)
    (tmp_path / "t.jsonl").write_text(json.dumps({"messages": rows[1]["chosen"]}) + "\n" +
                                      json.dumps({"text": "one\ntext"}) + "\n")
    texts = data.read_texts(str(tmp_path / "t.jsonl"))
    assert texts == [x + " No.\nUser: Sure?\nAssistant: Yes.", "one\ntext"]
    tok = data.train_tokenizer(texts * 10, vocab_size=300)
    assert tok.encode(x) + tok.encode(" No.\nUser: Sure?\nAssistant: Yes.") == tok.encode(texts[0])
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": sys_u}) + "\n" +
                                      json.dumps({"prompt": abc[:2]}) + "\n")
    assert data.read_prompts(str(tmp_path / "p.jsonl")) == [x, "User: a\nAssistant: b"]
    (tmp_path / "t.jsonl").write_text('{"text": "a"}\n{"txt": "b"}\n')
    with pytest.raises(data.DataError, match=f'^{tmp_path}/t.jsonl:2: missing field "text"'):
        data.read_texts(str(tmp_path / "t.jsonl"))


def test_read_pairs_implicit_conversations_ignore_other_fields(tmp_path):
    # as TRL's preference datasets with an implicit prompt (e.g. scores beside the conversations):
    # the prompt is the messages both begin with, other fields are ignored as TRL ignores them
    q, yes, no = msgs(("user", "Rain?")), msgs(("assistant", "No.")), msgs(("assistant", "Yes"))
    rows = [dict(chosen=q + yes, rejected=q + no, score_chosen=8.5, score_rejected=3.0, id="x"),
            dict(chosen=q + yes, rejected=q + no)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert data.read_pairs(str(tmp_path / "c.jsonl")) == [
        dict(prompt="User: Rain?\nAssistant:", chosen=" No.", rejected=" Yes")] * 2


def test_own_data_on_the_example_file(tmp_path):
    # the shipped file: a few dozen hand-written rows in all four formats, read without an error
    with open(EXAMPLE) as f:
        raw = [json.loads(line) for line in f]
    assert len(raw) >= 30 and {tuple(sorted(r)) for r in raw} == {("chosen", "prompt", "rejected"),
                                                                  ("chosen", "rejected")}
    assert {type(r["chosen"]) for r in raw} == {str, list}
    rows = data.read_pairs(EXAMPLE)
    out = tmp_path / "own"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "data.py"), "own", EXAMPLE, "--out",
                        str(out), "--vocab_size", "512"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    read = lambda name, key: [json.loads(line)[key] for line in open(out / name)]  # noqa: E731
    train = data.read_pairs(str(out / "pairs_train.jsonl"))
    val = data.read_pairs(str(out / "pairs_val.jsonl"))
    assert sorted(map(json.dumps, train + val)) == sorted(map(json.dumps, rows)) and len(val) == 4
    assert read("sft_train.jsonl", "text") == [r["prompt"] + r["chosen"] for r in train]
    assert read("sft_val.jsonl", "text") == [r["prompt"] + r["chosen"] for r in val]
    assert read("prompts_test.jsonl", "prompt") == [r["prompt"] for r in val]
    # the block printed is the longest pair with this tokenizer, BOS and EOS included: nothing cut
    tok = data.load_tokenizer(str(out / "tokenizer.json"))
    longest = max(len(data.encode_prompt(tok, r["prompt"]))
                  + max(len(data.encode_response(tok, r[k])) for k in ("chosen", "rejected"))
                  for r in rows)
    assert f"block_size {longest} (the longest pair is {longest} tokens" in p.stdout, p.stdout
    assert "0 of 36 prompts and 0 of 36 pairs' responses cut" in p.stdout
    st = data.tokenize_pairs(tok, rows, longest - 1, 8)[1]  # and one token less cuts something
    assert st["truncated_prompt"] + st["truncated_response"] >= 1
    # a smaller block: the counts are tokenize_pairs' own, and the chosen/rejected EOS losses apart
    logs = []
    assert data.own_data(EXAMPLE, str(out), vocab_size=512, block_size=48, log=logs.append) == 48
    ex, st = data.tokenize_pairs(tok, rows, 48, 24)
    lost = [sum(e[k][-1] != tok.eos for e in ex) for k in ("chosen", "rejected")]
    assert (f"{st['truncated_prompt']} of 36 prompts and {st['truncated_response']} of 36 pairs' "
            f"responses cut (EOS lost: {lost[0]} chosen, {lost[1]} rejected)") in logs[0]
    assert st["truncated_response"] > 0 and lost[0] != lost[1]  # chosen answers run longer here


def test_own_data_path_builds_its_own_cache_and_leaves_the_builtin_one(tmp_path, monkeypatch,
                                                                       capsys):
    """The README's own-data path as data.py own prints it (a tiny model and 2 steps added), run
    where a zero-argument run left the built-in task's cache: dpo.py builds the cache of your pairs
    in a folder of its own and leaves the built-in one as it was (bytes and mtime), a second run
    reuses it, and precompute.py alone on the same inputs writes to that same folder."""
    monkeypatch.chdir(tmp_path)
    logs = []
    block = data.own_data(EXAMPLE, "out/own", vocab_size=512, log=logs.append)
    sft_cmd, dpo_cmd = data.own_commands("out/own", block, 32)
    assert sft_cmd in logs[-1] and dpo_cmd in logs[-1]
    builtin = tmp_path / "out" / "ref_logps"
    builtin.mkdir(parents=True)
    for split in ("train", "val"):  # its fingerprint would not match these pairs: stale here
        precompute.save_ref_logps(str(builtin / f"{split}.safetensors"), torch.zeros(2, 3), {},
                                  {}, {})
    files = lambda folder: {f: (f.read_bytes(), f.stat().st_mtime_ns)  # noqa: E731
                            for f in folder.iterdir() if f.is_file()}
    before = files(builtin)
    small = {**TINY_MODEL, "block_size": block}
    sft.main(replace(plumbing.parse_config(sft.Config, sft_cmd.split()[2:]), **small, steps=2))
    dcfg = replace(plumbing.parse_config(dpo.Config, dpo_cmd.split()[2:]), steps=2, eval_k=1)
    pc = precompute.Config(ref_model=dcfg.ref_model, train_pairs=dcfg.train_pairs,
                           val_pairs=dcfg.val_pairs, max_len=dcfg.max_len,
                           max_prompt_len=dcfg.max_prompt_len)
    own = tmp_path / precompute.cache_dir(pc)
    assert re.fullmatch(r"out/ref_logps/pairs_train-[0-9a-f]{12}", precompute.cache_dir(pc))
    capsys.readouterr()
    dpo.main(dcfg)
    out = capsys.readouterr().out
    assert f"{precompute.cache_dir(pc)}/train.safetensors is missing: building it now" in out
    assert files(builtin) == before and sorted(f.name for f in files(own)) == [
        ".lock", "train.safetensors", "val.safetensors"]
    built = files(own)
    # the same inputs: the same cache, reused (one step is enough to have read it)
    dpo.main(replace(dcfg, out_dir="out/own/dpo2", stop_after=1))
    assert "is missing" not in capsys.readouterr().out and files(own) == built
    precompute.main(pc)  # what `python precompute.py --ref_model ... --train_pairs ...` runs
    assert files(builtin) == before and files(own).keys() == built.keys()
    assert all(files(own)[f][1] > built[f][1] for f in built if f.name != ".lock")  # rewritten
    # your pairs with the built-in π_ref (or val pairs, or prompts): the commands that make yours
    for cfg in (replace(dcfg, ref_model=dpo.Config.ref_model),
                replace(dcfg, test_prompts=dpo.Config.test_prompts),
                replace(pc, val_pairs=precompute.Config.val_pairs)):
        with pytest.raises(SystemExit, match=r"still the built-in task's .* python data\.py own "
                                             r"out/own/pairs_train\.jsonl --out out/own"):
            (dpo if isinstance(cfg, dpo.Config) else precompute).main(cfg)
    assert not os.path.exists("out/sft") and not os.path.exists("out/task")  # nothing built
    # pairs the task's generator writes (a regime's, e.g. out/task-capped) may use its π_ref
    rng = random.Random(0)
    (tmp_path / "capped.jsonl").write_text("".join(json.dumps(tasks.sample_pair(rng)) + "\n"
                                                   for _ in range(20)))
    precompute.check_own_inputs(precompute.Config(train_pairs="capped.jsonl"))


# ==================================================================================================
# truncation and batch layout (data.py, and every stage that samples from a prompt)
# ==================================================================================================

def test_tokenize_pairs_truncation_rule(tok):
    assert all(len(tok.encode(" " + w)) == 1
               for w in "the movie is great . i loved plot it felt".split())
    prompt, short = "the movie is great .", " i loved the plot ."   # 6 tokens with BOS, 6 with EOS
    long = " it felt great . it felt great . it felt great ."          # 13 with EOS
    rows = [dict(prompt=prompt, chosen=short, rejected=long)]
    x, ys, yl = (data.encode_prompt(tok, prompt), data.encode_response(tok, short),
                 data.encode_response(tok, long))
    assert (len(x), len(ys), len(yl)) == (6, 6, 13) and x[0] == tok.eos and yl[-1] == tok.eos
    ex, st = data.tokenize_pairs(tok, rows, max_len=19, max_prompt_len=4)    # 6 + 13 fits
    assert ex == [dict(index=0, prompt=x, chosen=ys, rejected=yl)]
    assert st == dict(rows=1, truncated_prompt=0, truncated_response=0, unusable=0,
                      chosen_lost_eos=0, rejected_lost_eos=0)
    # too long by 3: the prompt gives up 3 tokens (it may: max(16 - 13, 2) = 3 >= 2),
    # keeping its BOS
    ex, st = data.tokenize_pairs(tok, rows, max_len=16, max_prompt_len=2)
    assert (ex[0]["prompt"] == [tok.eos] + x[-2:] and ex[0]["rejected"] == yl
            and ex[0]["chosen"] == ys)
    assert st == dict(rows=1, truncated_prompt=1, truncated_response=0, unusable=0,
                      chosen_lost_eos=0, rejected_lost_eos=0)
    # max_prompt_len 5 stops the prompt at 5 tokens; the longer response is cut to
    # 16 - 5 = 11 (no EOS)
    ex, st = data.tokenize_pairs(tok, rows, max_len=16, max_prompt_len=5)
    assert (ex[0]["prompt"] == [tok.eos] + x[-4:] and ex[0]["rejected"] == yl[:11]
            and ex[0]["chosen"] == ys)
    assert st == dict(rows=1, truncated_prompt=1, truncated_response=1, unusable=0,
                      chosen_lost_eos=0, rejected_lost_eos=1)  # the longer one, cut, lost its EOS
    # a prompt already short enough is kept whole and the responses are cut
    ex, st = data.tokenize_pairs(tok, rows, max_len=12, max_prompt_len=8)
    assert ex[0]["prompt"] == x and ex[0]["rejected"] == yl[:6] and ex[0]["chosen"] == ys
    assert st == dict(rows=1, truncated_prompt=0, truncated_response=1, unusable=0,
                      chosen_lost_eos=0, rejected_lost_eos=1)
    # responses that differ only past the cut become identical: unusable, left out, counted; the
    # other rows keep their original index
    same = dict(prompt=prompt, chosen=long + " the plot is great .",
                rejected=long + " it felt fine .")
    ex, st = data.tokenize_pairs(tok, [rows[0], same, rows[0]], max_len=16, max_prompt_len=5)
    assert [e["index"] for e in ex] == [0, 2]
    assert st == dict(rows=3, truncated_prompt=3, truncated_response=3, unusable=1,
                      chosen_lost_eos=0, rejected_lost_eos=2)  # counted over the usable pairs
    with pytest.raises(AssertionError, match="max_prompt_len"):
        data.tokenize_pairs(tok, rows, max_len=8, max_prompt_len=8)


def test_one_prompt_truncation_rule_keeps_bos(tok, monkeypatch):
    ids = list(range(100, 110))  # a BOS (100) and 9 tokens
    assert data.truncate_prompt(ids, 4) == [100, 107, 108, 109]  # BOS and the last 3
    assert data.truncate_prompt(ids, 10) == ids and data.truncate_prompt(ids, 11) == ids
    # every stage that samples from a prompt hands the sampler this rule's ids: evaluate.py and
    # reward.py's offset keep block // 2 = 32 tokens (ppo.py: test_ppo_loop_wiring)
    long = " ".join(["the movie is great ."] * 8)
    x = data.encode_prompt(tok, long)
    assert len(x) > 32
    seen = []

    def spy(model, prompts, *a, **kw):
        seen.append(prompts)
        return generate(model, prompts, *a, **kw)
    for module in (evaluate, reward):
        monkeypatch.setattr(module, "generate", spy)
    lm = constant_gpt(tok.vocab_size, tok.eos)
    rm = GPT(GPTConfig(block_size=64, vocab_size=tok.vocab_size, n_layer=1, n_head=1, n_embd=4,
                       head="scalar")).eval()
    evaluate_policy(lm, lm, tok, [long, "it felt good ."], init_distributed(), k=1)
    reward.ref_scores(rm, lm, tok, [long, "it felt good ."], init_distributed(), seed=0)
    assert len(seen) == 3  # the policy's and π_ref's samples, and the offset's
    for prompts in seen:
        assert prompts == [data.truncate_prompt(x, 32), data.encode_prompt(tok, "it felt good .")]
        assert prompts[0][0] == tok.eos and prompts[0][1:] == x[-31:]


def test_ppo_and_online_dpo_say_how_many_prompts_they_cut(tiny, tiny_rm, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the movie is great .\n" * 6 + " ".join(["the plot is bad ."] * 6) + "\n"
                       + "i loved it .\n")
    said = []
    cfg = tiny_ppo_config(tiny, str(tiny_rm / "model.safetensors"), tmp_path / "ppo", str(prompts),
                          prompts=str(prompts), max_prompt_len=12)
    # r_φ labels: the hidden reward scores only the task's text, and "i loved it ." is not
    ocfg = online_dpo.Config(out_dir=str(tmp_path / "online"), sft=cfg.sft,
                             reward_model=cfg.reward_model, prompts=str(prompts),
                             test_prompts=str(prompts), rollout_batch=8, max_prompt_len=12)
    for stage, c in ((ppo, cfg), (online_dpo, ocfg)):
        _, _, _, ids, _ = stage.setup(c, CPU, said.append)
        assert [len(x) for x in ids].count(12) == 1 and max(map(len, ids)) == 12
    assert said.count(f"1 of 8 prompts of {prompts} are longer than --max_prompt_len 12 tokens: "
                      "each keeps its BOS and its last tokens") == 2


def test_tokenize_texts(tok):
    texts = ["it felt great . it felt good .", "it felt great . it felt good . it felt fine ."]
    ex, st = data.tokenize_texts(tok, texts, max_len=10)
    assert st == dict(rows=2, truncated=1)
    assert ex[0] == dict(index=0, prompt=[tok.eos], response=tok.encode(texts[0]) + [tok.eos])
    assert ex[1]["response"] == tok.encode(texts[1])[:9]


def test_collate_pairs_layout(tok):
    # cut mid-word
    rows = [dict(prompt="the movie is gre", chosen="at . it felt good .", rejected=" bad ."),
            dict(prompt="it felt good .", chosen=" i loved the plot . it felt great .",
                 rejected=" the end ."),
            dict(prompt="we saw it", chosen=" on monday .", rejected=" on friday . it felt dull .")]
    ex, _ = data.tokenize_pairs(tok, rows, max_len=64, max_prompt_len=8)
    b = data.collate_pairs(ex, tok.pad)
    ids, tg = b["input_ids"], b["targets"]
    T = max(len(e["prompt"]) + len(e[k]) for e in ex for k in ("chosen", "rejected"))
    assert ids.shape == tg.shape == (6, T) and ids.dtype == tg.dtype == torch.long
    assert b["index"].tolist() == [0, 1, 2] and b["index"].dtype == torch.long
    # [chosen; rejected]
    for i, (r, k) in enumerate((r, k) for k in ("chosen", "rejected") for r in rows):
        x, y = data.encode_prompt(tok, r["prompt"]), data.encode_response(tok, r[k])
        P, n = len(x), len(x) + len(y)
        assert ids[i, :P].tolist() == x and ids[i, P:n].tolist() == y    # the boundary is exact
        assert (ids[i, n:] == tok.pad).all()
        # position t predicts token t+1
        assert tg[i, P - 1:n - 1].tolist() == y
        assert (tg[i, :P - 1] == -100).all() and (tg[i, n - 1:] == -100).all()
    assert (tg[:, -1] == -100).all()
    hit = tg != -100
    assert (tg[:, :-1][hit[:, :-1]] == ids[:, 1:][hit[:, :-1]]).all()
    # tokenized apart: "gre" + "at" is not the " great" that tokenizing the joined text would give
    assert (data.encode_response(tok, "at . it felt good .")[0]
            != tok.encode("the movie is great .")[3])
    assert tok.decode(ids[0].tolist()) == rows[0]["prompt"] + rows[0]["chosen"]
