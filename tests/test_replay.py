"""Online DPO's replay file: online_dpo.py writes every pair it stepped on, in order, and dpo.py
trains on exactly those (--order file), or on the same batches in another order (--order steps).

The promises: the file holds the pairs and labels each round's step read, untied, in the global
batch's order; it resumes as the run does and is the same on two ranks; dpo.py --order file on it
is online DPO's run again, step for step; --order steps takes the same batches in a seeded order;
a bad row is an error naming its file, line and field."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import data
import dpo
import online_dpo
import precompute

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-5  # the order of fp32 sums: packed and padded batches, a cache and a live π_ref


def lines(path):
    return [json.loads(s) for s in open(path).read().splitlines()]


@pytest.fixture(scope="module")
def online(tiny, tmp_path_factory):  # noqa: F811
    """A short online DPO run (the hidden reward's argmax labels, which tie often here; 4 rounds
    of 8 pairs) whose steps are watched: the pairs each update read and their weights. Returns
    (its folder, its config dict, the watched rounds)."""
    root = tmp_path_factory.mktemp("replay")
    (root / "eval.jsonl").write_text("".join(open(f"{tiny.task}/prompts_test.jsonl")
                                             .readlines()[:2]))
    cfg = dict(sft=f"{tiny.sft}/model.safetensors", prompts=f"{tiny.task}/prompts_train.jsonl",
               test_prompts=str(root / "eval.jsonl"), iterations=4, rollout_batch=8,
               micro_batch_size=4, eval_k=1, lr=3e-3, warmup=1, reward="true", beta=0.1)
    seen, update = [], online_dpo.update

    def watched(models, opt, ex, *a, **kw):
        seen.append([(p["prompt"], p["chosen"], p["rejected"], w)
                     for p, w in zip(ex["pairs"], ex["keep"].tolist())])
        return update(models, opt, ex, *a, **kw)
    online_dpo.update = watched
    try:
        online_dpo.main(online_dpo.Config(out_dir=str(root / "one"), **cfg))
    finally:
        online_dpo.update = update
    return root, cfg, seen


def test_online_dpo_writes_the_pairs_it_stepped_on_in_order(online):
    root, cfg, seen = online
    rows = lines(root / "one" / "pairs.jsonl")
    # each round's pairs of nonzero weight, in the batch's order, the chosen as the loss took it
    want = [(k + 1, p, c, r) for k, rnd in enumerate(seen) for p, c, r, w in rnd if w]
    got = [(x["step"], x["prompt_ids"], x["chosen_ids"], x["rejected_ids"]) for x in rows]
    assert got == want
    assert len(seen) == cfg["iterations"] and any(not w for rnd in seen for *_, w in rnd), \
        "no round tied: the test cannot see ties left out"
    tok = data.load_tokenizer(f"{os.path.dirname(cfg['sft'])}/tokenizer.json")
    for x in rows:  # the texts, to read
        assert x["chosen"] == tok.decode(x["chosen_ids"])
        assert x["prompt"] == tok.decode(x["prompt_ids"])
    # the metrics' ties agree: a round's rows are its untied pairs
    m = lines(root / "one" / "metrics.jsonl")
    assert [sum(x["step"] == k + 1 for x in rows) for k in range(len(m))] == [
        round((1 - s["ties"]) * cfg["rollout_batch"]) for s in m]


@pytest.fixture(scope="module")
def replay(online, tiny):  # noqa: F811
    """dpo.py's replay of the online run's pairs.jsonl with its flags, the default packed batches
    and reference cache: the config, and the steps of the file by hand (rows grouped by "step")."""
    root, cfg, _ = online
    val = root / "val.jsonl"
    val.write_text("".join(open(f"{tiny.task}/pairs_val.jsonl").readlines()[:16]))
    pc = precompute.Config(out_dir=str(root / "cache"), ref_model=cfg["sft"],
                           train_pairs=str(root / "one" / "pairs.jsonl"), val_pairs=str(val))
    precompute.main(pc)  # log π_ref of the replayed pairs: online DPO ran π_ref live on them
    rep = dpo.Config(out_dir=str(root / "replay"), ref_model=cfg["sft"],
                     train_pairs=pc.train_pairs, val_pairs=pc.val_pairs, ref_logps=pc.out_dir,
                     test_prompts=cfg["test_prompts"], order="file",
                     batch_size=cfg["rollout_batch"], micro_batch_size=cfg["micro_batch_size"],
                     steps=cfg["iterations"], lr=cfg["lr"], warmup=cfg["warmup"],
                     beta=cfg["beta"], eval_k=1, eval_every=100)
    by_step = {}
    for i, x in enumerate(lines(rep.train_pairs)):
        by_step.setdefault(x["step"], []).append(i)
    return rep, list(by_step.values())


def file_steps(cfg, world=1):
    """The steps dpo.py cuts from cfg's train pairs for world ranks (dpo.replay_steps, as its setup
    calls it): lists of positions of the usable rows."""
    tok = data.load_tokenizer(f"{os.path.dirname(cfg.ref_model)}/tokenizer.json")
    rows = data.read_pairs(cfg.train_pairs)
    train, _ = data.tokenize_pairs(tok, rows, cfg.max_len, cfg.max_prompt_len, cfg.train_pairs)
    return dpo.replay_steps(rows, train, cfg, world)


def test_dpo_on_an_untied_runs_replay_file_is_its_run_bit_for_bit(tiny, tmp_path):  # noqa: F811
    # Oracle labels tie only identical completions: here none ties, so the file holds every pair
    # online DPO's micro-batches held, in their order. Replayed as online DPO ran it (padded
    # micro-batches, π_ref live, one process), every sum is the same sum in the same order: the
    # same weights and metrics bit for bit, on any CPU or GPU (no tolerance to be lucky within)
    (tmp_path / "eval.jsonl").write_text("".join(open(f"{tiny.task}/prompts_test.jsonl")
                                                 .readlines()[:2]))
    cfg = dict(sft=f"{tiny.sft}/model.safetensors", prompts=f"{tiny.task}/prompts_train.jsonl",
               test_prompts=str(tmp_path / "eval.jsonl"), iterations=4, rollout_batch=8,
               micro_batch_size=4, eval_k=1, lr=3e-3, warmup=1, reward="oracle", beta=0.1)
    online_dpo.main(online_dpo.Config(out_dir=str(tmp_path / "one"), **cfg))
    pairs = str(tmp_path / "one" / "pairs.jsonl")
    assert [x["step"] for x in lines(pairs)] == [k for k in (1, 2, 3, 4) for _ in range(8)], \
        "a pair tied: the file no longer holds every row online DPO's forward did"
    dpo.main(dpo.Config(out_dir=str(tmp_path / "replay"), ref_model=cfg["sft"], train_pairs=pairs,
                        val_pairs=f"{tiny.task}/pairs_val.jsonl", test_prompts=cfg["test_prompts"],
                        order="file", pack=False, ref="live", batch_size=8, micro_batch_size=4,
                        steps=4, lr=3e-3, warmup=1, beta=0.1, eval_k=1, eval_every=100))
    a, b = (lines(tmp_path / f / "metrics.jsonl") for f in ("one", "replay"))
    for k in ("loss", "rewards/margins", "logps/chosen", "logps/rejected", "grad_norm"):
        assert [x[k] for x in a] == [y[k] for y in b], k
    w1, w2 = (load_file(tmp_path / f / "model.safetensors") for f in ("one", "replay"))
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)


def test_dpo_on_the_replay_file_in_order_is_the_online_run_again(online, replay):
    # The same steps on the same pairs: every step's loss, margin and gradient norm are online
    # DPO's (the first step at π = π_ref included), to the fp32 rounding of three named
    # differences: online DPO's micro-batches also held the round's tied pairs (weight 0), which
    # the file leaves out, so each matmul sums the same terms blocked otherwise (every step's
    # gradient measured within 3e-7 of online DPO's); the replay packs its micro-batches; and
    # reads log π_ref from the cache, computed in precompute's batches. Without these, the test
    # above: bit for bit
    root, cfg, _ = online
    rep, _ = replay
    dpo.main(rep)
    a, b = lines(root / "one" / "metrics.jsonl"), lines(root / "replay" / "metrics.jsonl")
    assert len(a) == len(b) == cfg["iterations"]
    for k in ("loss", "rewards/margins", "logps/chosen", "grad_norm"):
        assert all(abs(x[k] - y[k]) <= TOL * max(1, abs(x[k])) for x, y in zip(a, b)), k
    assert abs(a[0]["loss"] - 0.6931472) < 1e-6  # step 1: π = π_ref, log 2 on every pair
    # The weights: AdamW's step lr·m/(√v + ε) is as large for a gradient of rounding noise as for
    # a real one, so the runs' weights differ by more than fp32 rounding wherever a gradient is
    # near 0, but by little beside how far training moved them from π_ref (measured: 3e-5 of it).
    # Not the attention's key bias, whose true gradient is 0 (softmax ignores a shift of every
    # score): its every move is noise, so only its size is bounded, lr per step
    w0, w1, w2 = (load_file(f) for f in (cfg["sft"], *(root / f / "model.safetensors"
                                                       for f in ("one", "replay"))))
    assert w1.keys() == w2.keys()
    for k in w1:
        if k.endswith("c_attn.bias"):
            assert (w1[k] - w2[k]).abs().max() <= 2 * cfg["lr"] * cfg["iterations"], k
        else:
            assert (w1[k] - w2[k]).norm() <= 1e-3 * (w1[k] - w0[k]).norm(), k


def test_dpo_order_steps_takes_the_files_steps_whole_in_an_order_its_seed_draws(online, replay):
    # --order steps: the same batches, each whole, in a seeded order, so step 1's loss is still
    # log 2 (π = π_ref) but its batch is another round's; the order differs from the file's
    root, cfg, _ = online
    rep, by_step = replay
    assert len(by_step) == cfg["iterations"]
    assert file_steps(rep) == by_step  # --order file: the file's steps in its order
    orders = [file_steps(dataclasses.replace(rep, order="steps", seed=s)) for s in range(6)]
    assert all(sorted(o) == sorted(by_step) for o in orders)  # the same steps, each whole
    assert len({str(o) for o in orders}) > 2, "every --seed draws one order"
    dpo.main(dataclasses.replace(rep, out_dir=str(root / "shuffled"), order="steps", seed=5))
    a, c = lines(root / "one" / "metrics.jsonl"), lines(root / "shuffled" / "metrics.jsonl")
    assert abs(c[0]["loss"] - 0.6931472) < 1e-6
    assert [x["loss"] for x in c[1:]] != pytest.approx([x["loss"] for x in a[1:]], abs=1e-4)
    # one pass: more steps than the file's batches is refused before any work
    with pytest.raises(SystemExit, match=r"--steps 5 is more than the 4 batches of one pass"):
        dpo.main(dataclasses.replace(rep, out_dir=str(root / "long"), steps=5))


def test_input_that_is_not_a_replay_is_refused_by_name(replay, tiny, tmp_path):  # noqa: F811
    rep, by_step = replay
    # texts with a "step": encoded again, online DPO's unfinished completions would gain an EOS
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({k: x[k] for k in ("step", "prompt", "chosen",
                                                                "rejected")}) + "\n"
                             for x in lines(rep.train_pairs)))
    with pytest.raises(data.DataError, match=r'texts.jsonl:1: a row with a "step" holds texts, '
                                             r'not the token ids.*Pass its pairs.jsonl with'):
        file_steps(dataclasses.replace(rep, train_pairs=str(texts)))
    # online DPO's own file on 2 ranks: its first step of an odd number of pairs, by hand
    odd = next(b for b in by_step if len(b) % 2)
    with pytest.raises(SystemExit, match=rf'pairs.jsonl:{odd[0] + 1}: the step of "step" '
                                         rf'{lines(rep.train_pairs)[odd[0]]["step"]} holds '
                                         rf'{len(odd)} pairs .*2 ranks cannot share evenly: '
                                         r'replay it on one process'):
        file_steps(rep, world=2)
    assert file_steps(rep, world=1) == by_step
    # a file without "step": a step per --batch_size rows, 8 pairs each here (not per
    # --micro_batch_size); a batch larger than the file says so, not "0 batches"
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(open(f"{tiny.task}/pairs_train.jsonl").readlines()[:16]))
    flat = dataclasses.replace(rep, train_pairs=str(plain), batch_size=8, micro_batch_size=4,
                               steps=2)
    assert file_steps(flat) == [list(range(8)), list(range(8, 16))]
    with pytest.raises(SystemExit, match=r"--batch_size 32 is more than the 16 rows of \S*"
                                         r"plain.jsonl, which have no \"step\""):
        file_steps(dataclasses.replace(flat, batch_size=32))


def test_file_batches_group_by_step_or_by_batch_size(tmp_path):
    rows = [dict(step=s, ids=()) for s in (1, 1, 2, 4, 4, 4)]  # read_pairs' rows of ids
    path = tmp_path / "p.jsonl"
    path.write_text("".join("{}\n" for _ in rows))
    examples = [dict(index=i) for i in (0, 1, 2, 4, 5)]  # row 3 unusable: left out of its step
    assert data.file_batches(rows, examples, 2, str(path)) == [[0, 1], [2], [3, 4]]
    plain = [{} for _ in range(7)]
    path.write_text("".join("{}\n" for _ in plain))
    assert data.file_batches(plain, [dict(index=i) for i in range(7)], 3, str(path)) == [
        [0, 1, 2], [3, 4, 5]]  # the short tail dropped
    for bad, line, what in (([1, 2, 1], 3, '"step" 1'), ([1, "2", 3], 2, '"step" "2"')):
        path.write_text("{}\n" * 3)
        with pytest.raises(data.DataError, match=f"p.jsonl:{line}: {what} must be an integer"):
            data.file_batches([dict(step=s, ids=()) for s in bad],
                              [dict(index=i) for i in range(3)], 1, str(path))
    path.write_text("{}\n" * 2)
    with pytest.raises(data.DataError, match="p.jsonl:2: some rows have a \"step\""):
        data.file_batches([dict(step=1, ids=()), {}], [dict(index=0), dict(index=1)], 1,
                          str(path))


def test_a_row_of_token_ids_is_read_as_ids_and_a_bad_one_named(tmp_path, tiny):  # noqa: F811
    tok = data.load_tokenizer(f"{tiny.sft}/tokenizer.json")
    path = tmp_path / "ids.jsonl"
    good = dict(step=1, prompt_ids=[tok.eos, 5, 6], chosen_ids=[7, 8], rejected_ids=[7, 9, tok.eos])
    path.write_text(json.dumps(good) + "\n")
    rows = data.read_pairs(str(path))
    ex, stats = data.tokenize_pairs(tok, rows, 64, 16, str(path))
    # kept as written: no EOS added to the chosen completion, which never ended; nothing was cut,
    # so no EOS counts as lost (the truncation warning stays silent)
    assert (ex[0]["prompt"], ex[0]["chosen"], ex[0]["rejected"]) == (
        [tok.eos, 5, 6], [7, 8], [7, 9, tok.eos])
    assert stats["chosen_lost_eos"] == stats["rejected_lost_eos"] == 0
    for change, msg in (({"chosen_ids": []}, 'field "chosen_ids" must be a non-empty list'),
                        ({"rejected_ids": [7, -1]}, 'field "rejected_ids" must be'),
                        ({"prompt_ids": "0 5"}, 'field "prompt_ids" must be'),
                        ({"rejected_ids": [7, 8]}, '"chosen_ids" and "rejected_ids" are')):
        path.write_text("\n" + json.dumps(good) + "\n" + json.dumps({**good, **change}) + "\n")
        with pytest.raises(data.DataError, match=f"ids.jsonl:3: {msg}"):
            data.read_pairs(str(path))
    # not what a sampled pair can hold: a prompt without its BOS or with padding, a response
    # that goes on after its EOS (generate stops a row there)
    E, P = tok.eos, tok.pad
    for change, msg in (({"prompt_ids": [5, 6]}, 'field "prompt_ids" starts with 5, not BOS'),
                        ({"prompt_ids": [E, P, 6]}, 'field "prompt_ids" holds the PAD id'),
                        ({"chosen_ids": [7, E, P, P]}, 'field "chosen_ids" goes on after its EOS '
                                                       r'\(position 1\) with 2 PAD ids'),
                        ({"rejected_ids": [7, E, 9]}, 'field "rejected_ids" goes on after its EOS '
                                                      r'\(position 1\) with 1 more tokens')):
        path.write_text("\n" + json.dumps(good) + "\n" + json.dumps({**good, **change}) + "\n")
        with pytest.raises(data.DataError, match=f"ids.jsonl:3: {msg}"):
            data.tokenize_pairs(tok, data.read_pairs(str(path)), 64, 16, str(path))
    # PAD's id before a response's end is a token the policy sampled (the whole vocabulary is
    # drawn from): kept, as online DPO's step trained on it
    path.write_text(json.dumps({**good, "chosen_ids": [7, P, 8]}) + "\n")
    ex, _ = data.tokenize_pairs(tok, data.read_pairs(str(path)), 64, 16, str(path))
    assert ex[0]["chosen"] == [7, P, 8]
    path.write_text(json.dumps({**good, "chosen_ids": [tok.vocab_size]}) + "\n")
    with pytest.raises(data.DataError, match=f"ids.jsonl:1: token id {tok.vocab_size} is not"):
        data.tokenize_pairs(tok, data.read_pairs(str(path)), 64, 16, str(path))


def test_the_replay_file_resumes_with_the_run_and_is_the_same_on_two_ranks(online):
    root, cfg, _ = online
    want = (root / "one" / "pairs.jsonl").read_text()
    # stopped after 2 rounds, a torn line left by a kill, then resumed: the same file
    split = online_dpo.Config(out_dir=str(root / "split"), stop_after=2, ckpt_every=2, **cfg)
    online_dpo.main(split)
    with open(root / "split" / "pairs.jsonl", "a") as f:
        f.write('{"step": 3, "prompt": "torn')
    online_dpo.main(online_dpo.Config(**{**split.__dict__, "stop_after": 0}))
    assert (root / "split" / "pairs.jsonl").read_text() == want
    # two gloo ranks, each sampling half of every round: rank 0 writes all, in the batch's order.
    # Oracle labels, which tie only identical completions: here no pair ties, so every round's
    # rows come from both ranks' halves and their order shows
    oracle = {**cfg, "reward": "oracle", "iterations": 2}
    online_dpo.main(online_dpo.Config(out_dir=str(root / "one-oracle"), **oracle))
    want = (root / "one-oracle" / "pairs.jsonl").read_text()
    assert [r["step"] for r in map(json.loads, want.splitlines())] == [1] * 8 + [2] * 8
    flags = [f"--{k}={v}" for k, v in {**oracle, "out_dir": root / "two"}.items()]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                        "online_dpo.py", *flags], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert (root / "two" / "pairs.jsonl").read_text() == want
