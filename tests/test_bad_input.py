"""Bad input is one clear error before any work: a bad row named by its file and line, a bad flag by
its name and its allowed values, a missing or mismatched input (π_ref's tokenizer, r_φ's, a val file
without a usable pair, too little data, a folder that cannot be written) by its path and what to do.

    pytest tests/test_bad_input.py
"""
import dataclasses
import inspect
import json
import math
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace

import pytest

import data
import dpo
import evaluate
import grpo
import online_dpo
import plumbing
import ppo
import precompute
import reward
import sft
from tests.helpers import (CPU, ROOT, dpo_cfg, dpo_pcfg, msgs, sft_args, tiny_ppo_config,
                           tiny_reward_config)


# ==================================================================================================
# rows: named by file and line (data.py)
# ==================================================================================================

GOOD = '{"prompt": "the plot is", "chosen": " good .", "rejected": " bad ."}'
U, A = msgs(("user", "hi")), msgs(("assistant", "hello"))


@pytest.mark.parametrize("bad, says", [
    ("not json", "not valid JSON"),
    ('["the plot", " good .", " bad ."]', "expected a JSON object, got an array"),
    ('{"prompt": "a", "chosen": " b"}', 'missing field "rejected"'),
    ('{"prompt": "a", "rejected": " b"}', 'missing field "chosen"'),
    ('{"prompt": null, "chosen": " b", "rejected": " c"}',
     'field "prompt" must be a string or a list of messages, got null'),
    ('{"prompt": "a", "chosen": 3, "rejected": " c"}',
     'field "chosen" must be a string or a list of messages, got a number'),
    ('{"prompt": "a", "chosen": " b", "rejected": ["c"]}',
     'rejected[0] is a string, not an object: the template renders'),
    ('{"prompt": "a", "chosen": "", "rejected": " c"}', 'field "chosen" is empty'),
    ('{"prompt": "a", "chosen": " c", "rejected": ""}', 'field "rejected" is empty'),
    ('{"prompt": "a", "chosen": " b", "rejected": " b"}', '"chosen" and "rejected" are identical'),
    ('{"chosen": "x b", "rejected": "x b"}', '"chosen" and "rejected" are identical'),
    ('{"chosen": "great plot", "rejected": "good plot"}', 'no "prompt" field'),  # no common space
    # ... or only at the start
    ('{"chosen": " yes", "rejected": " no"}', 'no "prompt" field'),
    # silent misreads before: a misspelled prompt became the responses' common first word " it"
    ('{"promt": "the plot", "chosen": " it felt good .", "rejected": " it felt bad ."}',
     'no "prompt" field but other fields (promt): a misspelled "prompt"?'),
    ('{"prompt": "a", "chosen": " b", "rejected": " c", "prompt": "d"}',
     'key "prompt" appears twice'),
    ('{"prompt": "a <|endoftext|> b", "chosen": " b", "rejected": " c"}',
     'field "prompt" contains <|endoftext|>, which the tokenizer would read as its special token'),
    ('{"prompt": "a", "chosen": " b<|pad|>", "rejected": " c"}', 'field "chosen" contains <|pad|>'),
    ('{"prompt": "a \\ud83d", "chosen": " b", "rejected": " c"}',
     'field "prompt" holds a lone surrogate escape'),
    # conversational rows (TRL's format) the template cannot render
    (json.dumps(dict(prompt=msgs(("tool", "x")), chosen=A, rejected=msgs(("assistant", "no")))),
     'prompt[0] has the role "tool": the template renders'),
    (json.dumps(dict(prompt=U, chosen=[{"role": "assistant", "content": "b", "name": "x"}],
                     rejected=A)), 'chosen[0] has the keys "role", "content", "name": the'),
    (json.dumps(dict(prompt=U, chosen=A, rejected=msgs(("assistant", 3)))),
     "rejected[0] has a content that is a number"),
    (json.dumps(dict(prompt=[], chosen=A, rejected=A)), 'field "prompt" must be a string or a list '
     'of messages, got an empty array'),
    (json.dumps(dict(prompt="hi", chosen=A, rejected=msgs(("assistant", "no")))),
     "mixes strings and lists of messages"),
    (json.dumps(dict(prompt=U, chosen=msgs(("user", "b")), rejected=A)),
     '"chosen" and "rejected" must each answer the prompt with an assistant message'),
    (json.dumps(dict(chosen=U + A, rejected=U + A + U + A)), "must each answer the prompt"),
    # implicit-prompt conversations may hold other fields, but not a bad message, nor no prompt
    (json.dumps(dict(chosen=U + msgs(("bot", "b")), rejected=U + A, score=1)),
     'chosen[1] has the role "bot"'),
    (json.dumps(dict(promt=U, chosen=A, rejected=msgs(("assistant", "no")))),
     'no "prompt" field, and the conversations share no first message'),
    # a prompt that ends with an assistant turn: the responses still answer as the assistant
    (json.dumps(dict(prompt=U + A, chosen=A, rejected=msgs(("user", "b")))),
     "must each answer the prompt"),
    (json.dumps(dict(chosen=U + A, rejected=msgs(("user", "yo")) + A)),
     'no "prompt" field, and the conversations share no first message'),
    (json.dumps(dict(prompt=U, chosen=msgs(("assistant", "<|endoftext|>")), rejected=A)),
     "chosen[0] contains <|endoftext|>"),
    ('{"prompt": [{"role": "user", "role": "assistant", "content": "x"}], "chosen": " b"}',
     'key "role" appears twice'),
    # data that parses but means nothing
    ('{"prompt": "a", "chosen": "  ", "rejected": " c"}', 'field "chosen" is only whitespace'),
    (json.dumps(dict(prompt=U, chosen=msgs(("assistant", "")), rejected=A)),
     'field "chosen" is only whitespace (an empty assistant message?)'),
    ('{"prompt": "a", "chosen": " b", "rejected": "b "}', 'differ only in white space'),
    # the problem named whole, where a message cut at 50 characters hid it
    (json.dumps(dict(prompt=msgs(("user", "x" * 60)) + [{"role": "user", "content": "y" * 60,
                                                         "Content": "z"}], chosen=A, rejected=A)),
     'prompt[1] has the keys "role", "content", "Content"'),
    ('{"prompt": "a", "chosen": " b", "rejected": " c"}\r{"prompt": "a", "chosen": " b"}',
     "a carriage return (\\r) inside a line: the file has old Mac line endings (CR only)?"),
])
def test_read_pairs_bad_rows_name_file_and_line(tmp_path, bad, says):
    path = tmp_path / "pairs.jsonl"
    # the blank line 2 is no row
    path.write_text(GOOD + "\n\n" + GOOD + "\n" + bad + "\n" + GOOD + "\n")
    with pytest.raises(data.DataError) as e:
        data.read_pairs(str(path))
    assert str(e.value).startswith(f"{path}:4: ") and says in str(e.value), str(e.value)


def test_read_files_other_errors(tmp_path):
    p = tmp_path / "bytes.jsonl"
    p.write_bytes(GOOD.encode() + b"\n" + b'{"prompt": "\xff"}\n')
    with pytest.raises(data.DataError, match=f"^{p}:2: not UTF-8"):
        data.read_pairs(str(p))
    for name, reader in [("e.jsonl", data.read_pairs), ("e.jsonl", data.read_prompts),
                         ("e.txt", data.read_texts)]:
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


def test_plain_text_of_json_rows_and_one_foreign_row_are_named_by_line(tiny, tmp_path):
    p = tmp_path / "prompts.txt"  # JSONL under a .txt name: each row would be a prompt, braces in
    p.write_text("the plot is good .\n" + json.dumps({"prompt": "the plot is"}) + "\n")
    for read in (data.read_prompts, data.read_texts):
        says = f"{p}:2: the line is a JSON object, but a file whose name does not end in .jsonl"
        with pytest.raises(data.DataError, match=re.escape(says)):
            read(str(p))
    p.write_text("{curly} is a word here .\n")  # not a JSON object: plain text, as written
    assert data.read_prompts(str(p)) == ["{curly} is a word here ."]
    # the built-in task's pairs with two rows of other text: the first one's line is named
    lines = open(f"{tiny.task}/pairs_train.jsonl").read().splitlines()[:20]
    foreign = {"prompt": "hello world ?", "chosen": " hi", "rejected": " go"}
    lines[6] = lines[11] = json.dumps(foreign)
    (tmp_path / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    cfg = precompute.Config(train_pairs=str(tmp_path / "pairs.jsonl"))
    says = "is not the built-in task's text (2 of 20 rows are not, the first at line 7), but --ref"
    with pytest.raises(SystemExit, match=re.escape(says)):
        precompute.check_own_inputs(cfg)


def test_full_texts_beside_a_prompt_in_every_row_are_refused_once_is_not(tmp_path):
    rows = [{"prompt": "the plot", "chosen": "the plot is good", "rejected": "the plot is bad"},
            {"prompt": "i loved it .", "chosen": " i loved it . it felt slow .",
             "rejected": " i loved it . the cast was fine ."}]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(data.DataError, match=re.escape(f'{path}:1: in every row "chosen" and '
                                                       '"rejected" both begin with the prompt')):
        data.read_pairs(str(path))
    # a sentence may repeat its prompt (the task's generator does, 1 row in 4,000 in `capped`)
    path.write_text(json.dumps(rows[1]) + "\n" + GOOD + "\n")
    assert len(data.read_pairs(str(path))) == 2


def test_read_files_directory_missing_and_bom(tmp_path):
    # a directory or a missing file is one error line naming it, for every reader (was a traceback)
    for reader in (data.read_pairs, data.read_prompts, data.read_texts):
        for path in (str(tmp_path), str(tmp_path / "nope.jsonl")):
            with pytest.raises(data.DataError, match=f"^{path}: cannot read it"):
                reader(path)
    # a UTF-8 BOM (Windows editors) is not part of the first row (was "not valid JSON")
    bom = b"\xef\xbb\xbf"
    (tmp_path / "p.jsonl").write_bytes(bom + (GOOD + "\n").encode() * 2)
    assert data.read_pairs(str(tmp_path / "p.jsonl")) == [
        dict(prompt="the plot is", chosen=" good .", rejected=" bad .")] * 2
    (tmp_path / "t.txt").write_bytes(bom + "it felt\nthe plot\n".encode())
    assert data.read_texts(str(tmp_path / "t.txt")) == ["it felt", "the plot"]
    (tmp_path / "q.jsonl").write_bytes(bom + b'{"prompt": "it felt"}\n')
    assert data.read_prompts(str(tmp_path / "q.jsonl")) == ["it felt"]
    # special tokens as text in plain text files too
    (tmp_path / "t.txt").write_text("it felt\nthe plot<|endoftext|>\n")
    with pytest.raises(data.DataError,
                       match=re.escape(f"{tmp_path}/t.txt:2: the line contains <|")):
        data.read_texts(str(tmp_path / "t.txt"))


# ==================================================================================================
# flags: every value checked before any work, the allowed ones named (plumbing.py)
# ==================================================================================================

def test_parse_config_flags_help_and_bad_values(capsys):
    cfg = plumbing.parse_config(sft.Config, ["--lr", "0.01", "--no-resume", "--n-layer", "3"])
    assert (cfg.lr == 0.01 and cfg.resume is False and cfg.n_layer == 3
            and cfg.steps == sft.Config.steps)
    with pytest.raises(SystemExit):
        plumbing.parse_config(sft.Config, ["--steps", "ten"])
    assert "invalid int value: 'ten'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plumbing.parse_config(sft.Config, ["--help"])
    # help comes from the field's comment
    assert "peak AdamW learning rate" in capsys.readouterr().out


def outside(interval, is_int):
    """Values just outside `interval` ("[lo, hi)" and the like), and NaN for a float flag."""
    lo, hi = (float(b) for b in interval[1:-1].split(","))
    step = 1 if is_int else 1e-6 * max(1.0, abs(lo))
    bad = [] if is_int else [math.nan]
    if math.isfinite(lo):
        bad.append(lo - step if interval[0] == "[" else lo)
    if math.isfinite(hi):
        bad.append(hi + step if interval[-1] == "]" else hi)
    elif not is_int:
        bad.append(math.inf)
    return [int(v) if is_int else v for v in bad]


def test_every_numeric_flag_of_every_stage_is_checked_before_any_work(tmp_path, capsys):
    from study import compare, costs, figure, gpu, kv_cache, tune
    configs = [m.Config for m in (sft, reward, precompute, dpo, ppo, grpo, online_dpo, evaluate,
                                  compare, costs, figure, gpu, kv_cache, tune)]
    checked = 0
    for cls in configs:
        for f in dataclasses.fields(cls):
            if isinstance(f.default, bool) or not isinstance(f.default, (int, float)):
                continue
            interval = plumbing.FLAG_RANGES[f.name]  # every numeric flag has one
            assert plumbing.in_range(f.default, interval), (cls.__module__, f.name)
            for value in outside(interval, isinstance(f.default, int)):
                with pytest.raises(SystemExit) as e:
                    plumbing.parse_config(cls, [f"--{f.name}={value}"])
                assert f"--{f.name} " in str(e.value) and interval in str(e.value), e.value
                checked += 1
    assert checked > 150
    # a value a field's comment gives a meaning to ("0 = no curves", "0: plain DPO") is allowed
    documented = 0
    for cls in configs:
        for line in inspect.getsource(cls).splitlines():
            m = re.match(r"\s+(\w+): (?:int|float) = .*#.*[ (]0(?: =|:) ", line)
            if m:
                assert plumbing.in_range(0, plumbing.FLAG_RANGES[m.group(1)]), line
                documented += 1
    assert documented >= 7
    # the cases a review found crashing or saving π_ref silently, refused by the CLI before any
    # work: nothing is written, not even the output folder
    for script, args in (("dpo.py", ["--steps", "-3"]), ("sft.py", ["--batch_size", "0"]),
                         ("ppo.py", ["--temperature", "1e-12"])):
        out = tmp_path / "never"
        p = subprocess.run([sys.executable, os.path.join(ROOT, script), *args, "--out_dir",
                            str(out)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert p.returncode != 0 and f"error: {args[0]} " in p.stderr, (script, args, p.stderr)
        assert "Traceback" not in p.stderr and not out.exists()
    # --help names the allowed values
    with pytest.raises(SystemExit):
        plumbing.parse_config(dpo.Config, ["--help"])
    assert "allowed: [0.001, inf)" in capsys.readouterr().out


def test_split_batch_derives_accumulation_or_says_why_not():
    assert plumbing.split_batch(64, 8, 2) == 4 and plumbing.split_batch(32, 32, 8) == 1
    with pytest.raises(SystemExit, match="not divisible by the 3 ranks"):
        plumbing.split_batch(64, 8, 3)
    with pytest.raises(SystemExit, match="not a multiple of --micro_batch_size 12"):
        plumbing.split_batch(64, 12, 2)


def test_grpo_refuses_bad_values_before_any_work(tmp_path):
    for args, says in ((["--group_size", "1"], "error: --group_size 1 is outside its allowed "
                        "values [2, inf)"),
                       (["--reward", "bt"], "error: --reward must be 'model', 'true' or 'oracle', "
                        "not 'bt'"),
                       (["--rollout_batch", "30"], "error: --rollout_batch 30 is not a multiple "
                        "of --group_size 4")):
        out = tmp_path / "never"
        p = subprocess.run([sys.executable, os.path.join(ROOT, "grpo.py"), *args, "--out_dir",
                            str(out)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert p.returncode != 0 and not out.exists(), p.stderr
        assert p.stderr.strip() == says, p.stderr


def test_online_dpo_refuses_an_unknown_labeller(tmp_path):
    # one line naming the allowed values, before any work: no output folder, no traceback
    out = tmp_path / "never"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "online_dpo.py"), "--reward", "bt",
                        "--out_dir", str(out)], capture_output=True, text=True, timeout=60,
                       cwd=tmp_path)
    assert p.returncode != 0 and not out.exists(), p.stderr
    assert p.stderr.strip() == "error: --reward must be 'model', 'true' or 'oracle', not 'bt'"


# ==================================================================================================
# inputs and outputs: the file named, and what to do
# ==================================================================================================

def test_sft_explicit_missing_input_is_an_error_naming_it(tiny, tmp_path):
    with pytest.raises(SystemExit, match="nope.txt does not exist"):
        sft.main(sft.Config(**{**sft_args(tiny, tmp_path),
                               "train_text": str(tmp_path / "nope.txt")}))


def test_a_reference_without_its_tokenizer_is_named(tiny, tmp_path):
    os.makedirs(tmp_path / "ref")
    shutil.copyfile(f"{tiny.sft}/model.safetensors", tmp_path / "ref" / "model.safetensors")
    pairs = f"{tiny.task}/pairs_val.jsonl"
    says = "ref/tokenizer.json does not exist: π_ref's tokenizer is read from the folder of --"
    with pytest.raises(SystemExit, match=says + "ref_model"):  # and so dpo.py
        precompute.main(precompute.Config(out_dir=str(tmp_path / "cache"), train_pairs=pairs,
                                          ref_model=str(tmp_path / "ref" / "model.safetensors"),
                                          val_pairs=pairs))
    with pytest.raises(SystemExit, match=says + "sft"):
        reward.main(tiny_reward_config(tiny, tmp_path / "reward", train_pairs=pairs,
                                       val_pairs=pairs,
                                       sft=str(tmp_path / "ref" / "model.safetensors")))


def test_a_reward_model_of_another_tokenizer_is_refused_and_a_reformatted_one_is_not(
        tiny, tiny_rm, ppo_test_prompts, tmp_path):
    os.makedirs(tmp_path / "rm")
    rm = str(tmp_path / "rm" / "model.safetensors")
    shutil.copyfile(tiny_rm / "model.safetensors", rm)
    spec = json.loads((tiny_rm / "tokenizer.json").read_text())
    (tmp_path / "rm" / "tokenizer.json").write_text(json.dumps(spec, separators=(",", ":")))
    cfg = tiny_ppo_config(tiny, rm, tmp_path / "ppo", ppo_test_prompts)
    ocfg = online_dpo.Config(out_dir=str(tmp_path / "online"), sft=cfg.sft, reward_model=rm,
                             prompts=cfg.prompts, test_prompts=ppo_test_prompts, rollout_batch=8)
    ppo.setup(cfg, CPU, print)  # the same tokenizer written compact: accepted
    online_dpo.setup(ocfg, CPU, print)
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two words trade ids: another tokenizer
    (tmp_path / "rm" / "tokenizer.json").write_text(json.dumps(spec))
    says = f"--reward_model {rm} was trained with another tokenizer"
    with pytest.raises(SystemExit, match=re.escape(says)):
        ppo.setup(cfg, CPU, print)
    with pytest.raises(SystemExit, match=re.escape(says)):
        online_dpo.setup(ocfg, CPU, print)
    online_dpo.setup(replace(ocfg, reward="true"), CPU, print)  # no r_φ read: no refusal
    os.remove(tmp_path / "rm" / "tokenizer.json")  # an r_φ from before reward.py wrote one
    with pytest.raises(SystemExit, match="rm/tokenizer.json does not exist: --reward_model"):
        ppo.setup(cfg, CPU, print)


def test_a_val_file_without_a_usable_pair_is_refused_before_training(tiny, dpo_cache,
                                                                     tmp_path):
    # every row's two responses differ only after 64 tokens: once cut, they are identical
    long = " the movie is good ." * 20
    row = json.dumps({"prompt": "i liked it .", "chosen": long + " yes", "rejected": long + " no"})
    (tmp_path / "val.jsonl").write_text((row + "\n") * 3)
    val, train = str(tmp_path / "val.jsonl"), f"{tiny.root}/dpo-data/pairs_train.jsonl"
    says = "val.jsonl has no usable pair: in each row chosen and rejected are identical once cut to"
    with pytest.raises(SystemExit, match=says):
        dpo.main(dpo_cfg(tiny, "unused", out_dir=str(tmp_path / "dpo"), val_pairs=val, ref="live"))
    with pytest.raises(SystemExit, match=says):
        reward.main(tiny_reward_config(tiny, tmp_path / "reward", val_pairs=val))
    for stage in ("dpo", "reward"):  # refused before the first step
        assert not os.path.exists(tmp_path / stage / "metrics.jsonl")
    with pytest.raises(SystemExit, match=says):
        precompute.main(precompute.Config(out_dir=str(tmp_path / "cache"), train_pairs=train,
                                          ref_model=f"{tiny.sft}/model.safetensors", val_pairs=val))
    assert not os.path.exists(tmp_path / "cache" / "train.safetensors")  # nor the train split's


def test_too_little_data_says_how_much_there_is(tiny, dpo_cache, tmp_path):
    (tmp_path / "five.txt").write_text("the movie is good . it felt odd .\n" * 5)
    with pytest.raises(SystemExit, match="five.txt has 5 usable texts, fewer than --batch_size 16"):
        sft.main(sft.Config(**{**sft_args(tiny, tmp_path / "sft"),
                               "train_text": str(tmp_path / "five.txt")}))
    rows = open(f"{tiny.root}/dpo-data/pairs_train.jsonl").readlines()[:5]
    (tmp_path / "five.jsonl").write_text("".join(rows))
    five = str(tmp_path / "five.jsonl")
    with pytest.raises(SystemExit, match="five.jsonl has 5 usable pairs, fewer than --batch_size "
                                         "16"):
        dpo.main(dpo_cfg(tiny, "unused", out_dir=str(tmp_path / "dpo"), train_pairs=five,
                         ref="live"))
    with pytest.raises(SystemExit, match="five.jsonl has 5 usable pairs, fewer than --batch_size "
                                         "8"):
        reward.main(tiny_reward_config(tiny, tmp_path / "reward", train_pairs=five))


def test_truncation_counts_lost_eos_per_side_and_warns(tiny, dpo_cache, tmp_path,
                                                       capsys):
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    long, short = " the movie is good ." * 10, " it felt odd ."
    rows = [dict(prompt="i liked it .", chosen=long, rejected=short),
            dict(prompt="i hated it .", chosen=short, rejected=long + " and bad .")]
    ex, st = data.tokenize_pairs(tok, rows, 32, 8)
    assert (st["chosen_lost_eos"], st["rejected_lost_eos"], st["truncated_response"]) == (1, 1, 2)
    assert [e[k][-1] == tok.eos for e in ex for k in ("chosen", "rejected")] == [0, 1, 1, 0]

    def stats(c, r, n=100, tp=0):
        return dict(rows=n, truncated_prompt=tp, truncated_response=max(c, r), unusable=0,
                    chosen_lost_eos=c, rejected_lost_eos=r)

    warn = lambda s: data.truncation_warning(s, "f", 64, "")  # noqa: E731
    assert warn(stats(4, 0)) == ""  # 4 of 100 cut, and 4 = 2·√4: within chance
    assert "cuts f unevenly: 0 of 100 prompts" in warn(stats(5, 0))  # 5 > 2·√5 = 4.47
    assert "cuts f heavily:" in warn(stats(3, 3, tp=6))  # 6 > 5% of 100
    w = data.truncation_warning(stats(49, 3, n=66, tp=61), "hh.jsonl", 64, "Fix it.")  # the issue's
    assert w.startswith("WARNING: truncation to 64 tokens cuts hh.jsonl heavily and unevenly: 61 "
                        "of 66 prompts and 49 of 66 pairs' responses cut; 49 chosen and 3 rejected "
                        "responses lost their EOS.") and w.endswith("Fix it.")
    # a stage says it, and what to do, before anything else can fail (here: too few pairs)
    (tmp_path / "hh.jsonl").write_text("".join(json.dumps(dict(rows[0], prompt=f"i liked {i} ."))
                                               + "\n" for i in range(8)))
    cfg = dpo_cfg(tiny, "unused", out_dir=str(tmp_path / "dpo"), ref="live", max_len=32,
                  max_prompt_len=8, train_pairs=str(tmp_path / "hh.jsonl"))
    with pytest.raises(SystemExit, match="fewer than --batch_size 16"):
        dpo.main(cfg)
    out = capsys.readouterr().out
    assert ("hh.jsonl heavily and unevenly: 0 of 8 prompts and 8 of 8 pairs' responses cut; 8 "
            "chosen and 0 rejected") in out and "Raise --max_len (up to π_ref's block_size)" in out


def test_outputs_that_cannot_be_written_are_refused_before_any_work(tiny, dpo_cache,
                                                                    tmp_path):
    (tmp_path / "a_file").write_text("in the way")
    in_the_way = str(tmp_path / "a_file")
    # refused before the inputs are even looked at (the missing train text would say so)
    cfg = {**sft_args(tiny, in_the_way), "train_text": str(tmp_path / "missing.txt")}
    with pytest.raises(SystemExit, match=f"{in_the_way} is a file, not a folder: move it away, or "
                                         "pick another --out_dir"):
        sft.main(sft.Config(**cfg))
    os.makedirs(tmp_path / "dpo")
    (tmp_path / "dpo" / "ckpt").write_text("in the way")  # found at the first checkpoint, before
    with pytest.raises(SystemExit, match="dpo/ckpt is a file, not a folder"):
        dpo.main(dpo_cfg(tiny, "unused", out_dir=str(tmp_path / "dpo")))
    assert sorted(os.listdir(tmp_path / "dpo")) == [".lock", "ckpt"]  # no step run, no metrics
    # a cache to be built into a file: refused before anything is built or trained
    with pytest.raises(SystemExit, match=f"{in_the_way} is a file, not a folder: move it away, or "
                                         "pick another --ref_logps"):
        dpo.main(dpo_cfg(tiny, "unused", out_dir=str(tmp_path / "dpo2"), ref_logps=in_the_way))
    # a folder under a file cannot be created
    with pytest.raises(SystemExit, match=r"cannot write in .*a_file/sub \(Not a directory\): pick "
                                         "another --out_dir"):
        precompute.main(dpo_pcfg(tiny, out=str(tmp_path / "a_file" / "sub")))


# ==================================================================================================
# settings and inputs that trained to nothing: refused by name, before any step
# ==================================================================================================

def refused(script, args, out, cwd):
    """Run `script args --out_dir out`; it must fail with one error line and no traceback, having
    written nothing in out (at most its lock and an empty ckpt folder): returns that line."""
    p = subprocess.run([sys.executable, os.path.join(ROOT, script), *args, "--out_dir", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=cwd)
    assert p.returncode != 0 and "Traceback" not in p.stderr, (script, p.stderr[-3000:])
    written = [os.path.join(r, f) for r, _, fs in os.walk(out) for f in fs if f != ".lock"]
    assert not written, (script, written)
    return p.stderr.strip().splitlines()[-1]


def loop_args(tiny, script):
    """A tiny run's flags for the RL loop `script`, from the tiny π_ref on the built-in task."""
    args = ["--sft", f"{tiny.sft}/model.safetensors", "--prompts",
            f"{tiny.task}/prompts_train.jsonl", "--test_prompts", f"{tiny.task}/prompts_test.jsonl",
            "--rollout_batch", "8", "--micro_batch_size", "2"]
    # ppo.py's critic starts from r_φ, whose default would be built: π_ref's trunk, for --reward
    # true (a test of --reward model passes its own)
    return args + ([] if script == "online_dpo.py" else ["--mini_batch", "4"]) + (
        ["--reward_model", args[1]] if script == "ppo.py" else [])


def test_a_language_model_passed_as_the_reward_model_is_refused(tiny, tmp_path):
    # a fresh scalar head on an LM's trunk is zero: it scored every completion 0 (grpo.py), and
    # online DPO's pairs tied
    lm = f"{tiny.sft}/model.safetensors"
    says = (f"error: --reward_model {lm} is not a reward model: it is a language model (head "
            "'lm', stage 'sft'), under which a fresh scalar head would start at zero and score "
            "every completion 0. Pass reward.py's model.safetensors")
    for script in ("grpo.py", "ppo.py", "online_dpo.py"):
        args = loop_args(tiny, script) + ["--reward_model", lm]
        assert refused(script, args, tmp_path / script, tmp_path).startswith(says), script
    # PPO-GT: r_φ scores nothing; the critic may start from π_ref's own trunk
    test = f"{tiny.task}/prompts_test.jsonl"
    ppo.setup(tiny_ppo_config(tiny, lm, tmp_path / "gt", test, reward="true"), CPU, print)
    (tmp_path / "notes.safetensors").write_text("not a model")
    with pytest.raises(SystemExit, match="notes.safetensors is not a model file of this project"):
        ppo.setup(tiny_ppo_config(tiny, str(tmp_path / "notes.safetensors"), tmp_path / "x",
                                  test), CPU, print)


def test_a_simpo_margin_past_certainty_over_chance_is_refused(tiny, dpo_cache, tmp_path):
    # γ 1e30 read as a loss of 1e30 every step. The bound, by hand: β 2 x ln 403 (the tiny task's
    # vocabulary) = 2 x 5.99894 = 11.998 nats; SimPO's paper's γ (0.3 to 1.6) is far inside it
    V = json.loads(open(f"{tiny.sft}/tokenizer.json").read())["model"]["vocab"]
    assert len(V) == 403  # PAD and EOS among them
    c = dpo_cfg(tiny, "unused", loss="simpo", beta=2.0)
    args = ["--ref_model", c.ref_model, "--train_pairs", c.train_pairs, "--val_pairs",
            c.val_pairs, "--test_prompts", c.test_prompts, "--loss", "simpo", "--beta", "2"]
    for gamma in ("1e+30", "12"):
        said = refused("dpo.py", args + ["--simpo_gamma", gamma], tmp_path / gamma, tmp_path)
        assert said == (f"error: --simpo_gamma {gamma} is above --beta 2 x ln V = 11.998 (V = 403, "
                        "π_ref's vocabulary): the margin γ/β is in nats per token, and beyond ln V "
                        "(certainty over a uniform guess) no pair can be asked to reach it; pass a "
                        "γ in [0, 11.998] (SimPO's paper: 0.3 to 1.6 at β 2 to 2.5)"), said
    dpo.setup(replace(c, simpo_gamma=11.997, out_dir=str(tmp_path / "inside")), CPU, print)


def test_a_prompt_length_that_leaves_no_response_is_refused(tiny, tmp_path):
    # 63 of a 64-token block sampled 1-token completions; 56 leaves the 8 a response needs
    for script in ("grpo.py", "online_dpo.py", "ppo.py"):
        args = loop_args(tiny, script) + ["--reward", "true", "--max_prompt_len"]
        said = refused(script, args + ["63"], tmp_path / script, tmp_path)
        assert said.startswith("error: --max_prompt_len 63 leaves 1 tokens of π_ref's 64-token "
                               "block for the response, fewer than 8 ("), (script, said)
        assert said.endswith("pass --max_prompt_len 56 or less"), said
        assert refused(script, args + ["57"], tmp_path / script, tmp_path).startswith(
            "error: --max_prompt_len 57 leaves 7 tokens")
    for stage in (grpo, online_dpo, ppo):  # the floor itself is allowed
        lm = f"{tiny.sft}/model.safetensors"
        stage.load_models(stage.Config(sft=lm, reward_model=lm, reward="true", max_prompt_len=56),
                          CPU, data.load_tokenizer(f"{tiny.sft}/tokenizer.json"))


def test_the_hidden_reward_refuses_prompts_of_another_text(tiny, tmp_path):
    # iterative_dpo.py's rule, in every loop whose scorer is the hidden reward
    (tmp_path / "chat.txt").write_text("hello there , how are you ?\n" * 8)
    chat = str(tmp_path / "chat.txt")
    for script, scorer in (("grpo.py", "true"), ("grpo.py", "oracle"), ("online_dpo.py", "true"),
                           ("online_dpo.py", "oracle"), ("ppo.py", "true")):
        args = loop_args(tiny, script) + ["--reward", scorer, "--prompts", chat]
        said = refused(script, args, tmp_path / f"{script}-{scorer}", tmp_path)
        assert said == (f"error: --prompts {chat}: --reward {scorer}'s scorer is the built-in "
                        "task's hidden reward, which scores only the task's text: pass its prompts "
                        "(out/task/prompts_*.jsonl)"), said
    args = ["--sft", f"{tiny.sft}/model.safetensors", "--prompts", chat, "--test_prompts",
            f"{tiny.task}/prompts_test.jsonl", "--val_pairs", f"{tiny.task}/pairs_val.jsonl"]
    said = refused("iterative_dpo.py", args, tmp_path / "iterative", tmp_path)
    assert said == (f"error: {chat}: the labeller is the built-in task's hidden reward, which "
                    "scores only the task's text: pass its prompts (out/task/prompts_*.jsonl)")


def test_online_dpo_refuses_rounds_too_small_for_its_collapse_rule(tiny, tmp_path):
    # one pair a round: its first tie read as "the run collapsed"
    for n in ("1", "7"):
        args = loop_args(tiny, "online_dpo.py") + ["--reward", "true", "--rollout_batch", n,
                                                   "--micro_batch_size", "1"]
        said = refused("online_dpo.py", args, tmp_path / n, tmp_path)
        assert said == (f"error: --rollout_batch {n} is fewer than 8 pairs a round: a round whose "
                        f"pairs all tie stops the run as collapsed, and {n} healthy pairs can all "
                        "tie by chance (up to 9% of a round's pairs do); pass --rollout_batch 8 or "
                        "more"), said
