"""The built-in task: a toy copy of the DPO paper's controlled-sentiment experiment, generated from
a seed, with its hidden true reward.

    python task.py                   # build out/task if it is missing, then show a few pairs
    python task.py --regime capped   # a regime of the task: default, capped, unseen or shifted;
                                     # here out/task-capped (--out_dir to choose)
    python task.py --help            # --seed, --out_dir

It writes its preference pairs in the JSONL schema a user brings ({"prompt", "chosen",
"rejected"}), so every stage reads them through data.py's user path.
"""
import json
import math
import os
import random
import re
import shutil
import time

import numpy as np

import data
from plumbing import atomic_write_text, barrier, check, require_stage

# The built-in task: a toy copy of the controlled-sentiment experiment of Rafailov et al. 2023,
# sec. 6.1 (IMDb prefixes, a sentiment classifier as the true reward). A text is a short "review"
# whose latent sentiment p is drawn once; each sentiment slot is positive with probability p. Every
# word belongs to one list and the templates differ in their first words, so a text determines every
# choice that made it, and text_logprob can give its exact probability.

TEMPLATES = ["the {noun} is {adj} .", "the {noun} was {adj} and {adj} .", "i {verb} the {noun} .",
             "it felt {adj} .", "we saw it on {day} ."]  # chosen uniformly
NEUTRAL = {"{noun}": ["movie", "plot", "cast", "music", "ending", "story", "acting", "script"],
           "{day}": ["monday", "tuesday", "friday", "saturday", "sunday"]}
# The hidden reward's per-word weights: a naive-Bayes sentiment score, as the paper's classifier.
POSITIVE_ADJ = {"great": 2.0, "superb": 2.0, "lovely": 1.5, "fun": 1.5, "good": 1.0, "nice": 1.0,
                "fine": 0.5, "decent": 0.5}
NEGATIVE_ADJ = {"awful": -2.0, "terrible": -2.0, "boring": -1.5, "dull": -1.5, "bad": -1.0,
                "weak": -1.0, "slow": -0.5, "odd": -0.5}
POSITIVE_VERB = {"loved": 2.0, "enjoyed": 1.5, "liked": 1.0}
NEGATIVE_VERB = {"hated": -2.0, "disliked": -1.5, "endured": -1.0}
SENTIMENT = {"{adj}": (list(POSITIVE_ADJ), list(NEGATIVE_ADJ)),
             "{verb}": (list(POSITIVE_VERB), list(NEGATIVE_VERB))}
WEIGHTS = {**POSITIVE_ADJ, **NEGATIVE_ADJ, **POSITIVE_VERB, **NEGATIVE_VERB}
# The best behaviour: the words of the highest weight (great, superb, loved), which the unseen
# regime keeps out of its pair pool.
TOP_WORDS = {w for w, v in WEIGHTS.items() if v == max(WEIGHTS.values())}
P_VALUES = (0.1, 0.3, 0.5, 0.7, 0.9)  # the latent sentiment, uniform
P_STOP = 0.35                         # after each sentence from the 2nd on: memoryless length
MAX_SENTENCES = 8                     # so every text fits a 64-token context with BOS and EOS
SIZES = dict(sft_train=20000, sft_val=1000, pairs_train=4000, pairs_val=500,
             prompts_train=2000, prompts_val=200, prompts_test=200)
# Two held-out prompt sets: every setting a study chooses (lr, length, which runs make a frontier)
# is chosen on prompts_val, and every number it reports is read on prompts_test, never tuned on.

def _sentence(rng, p):
    words = []
    for w in rng.choice(TEMPLATES).split():
        if w in SENTIMENT:
            pos, neg = SENTIMENT[w]
            w = rng.choice(pos if rng.random() < p else neg)
        elif w in NEUTRAL:
            w = rng.choice(NEUTRAL[w])
        words.append(w)
    return " ".join(words)

def _sentences(rng, p, k):
    """Sentences k+1, k+2, ... of a text whose first k are written (k = 0: a whole text). At least
    two in all and at least one more; after each from the 2nd on, stop with probability P_STOP."""
    out = []
    while True:
        out.append(_sentence(rng, p))
        k += 1
        if k >= 2 and (k == MAX_SENTENCES or rng.random() < P_STOP):
            return out

def sample_text(rng, p_values=P_VALUES):
    return " ".join(_sentences(rng, rng.choice(p_values), 0))

def sample_prompt(rng, p_values=P_VALUES):
    """An opening of a text: its first one or two sentences. Returns (latent p, sentences,
    prompt)."""
    p, k = rng.choice(p_values), rng.choice((1, 2))
    return p, k, " ".join(_sentence(rng, p) for _ in range(k))

def sample_pair(rng, p_values=P_VALUES, reject=None, redraw=None):
    """Two continuations of one prompt by the same generator (same latent p), labelled by
    Bradley-Terry on the hidden reward: chosen is the first with probability sigmoid(r1 - r2).
    With reject(prompt, response) (a regime's rule: capped, unseen), a response it rejects is
    redrawn from the `redraw` stream until it is not: rejection sampling, so each response is the
    generator's, conditioned on the rule (and the two distinct). The prompt and the label's uniform
    come from `rng` first, so a pair whose responses the rule kept is the default pair, byte for
    byte, and so is a kept response of a pair whose other one was redrawn."""
    p, k, prompt = sample_prompt(rng, p_values)
    a = b = ""
    while a == b:
        # responses start with the space
        a, b = (" " + " ".join(_sentences(rng, p, k)) for _ in range(2))
    u = rng.random()
    if reject is not None:
        while reject(prompt, a):
            a = " " + " ".join(_sentences(redraw, p, k))
        while reject(prompt, b) or b == a:
            b = " " + " ".join(_sentences(redraw, p, k))
    if not bradley_terry(u, true_reward(prompt, a), true_reward(prompt, b)):
        a, b = b, a
    return dict(prompt=prompt, chosen=a, rejected=b)

def bradley_terry(u, r_a, r_b):
    """The labeller of every arm that is labelled by the hidden reward (the offline pool here,
    online and iterative DPO's --reward oracle): is a preferred to b? Yes with probability
    σ(r_a - r_b), the Bradley-Terry model (Bradley & Terry 1952; Eq. 1 of Rafailov et al. 2023),
    drawn as u < σ(r_a - r_b) for a uniform u in [0, 1). Equal rewards are a coin flip."""
    return u < 1 / (1 + math.exp(r_b - r_a))


def _words(text):
    """The words has_top_word reads: runs of letters, lower-cased ("greatly" is one word)."""
    return re.findall(r"[a-z]+", text.lower())

# What a malformed sentence earns instead of its words' weights. Below 0, so a sentence off the
# language never adds reward and a completion made only of them scores below pi_ref's mean (0: the
# reward is symmetric about it); one unit, as much as a completion that never emitted EOS loses
# (evaluate.MISSING_EOS_SCORE), so both ways of leaving the language cost alike, while a valid
# sentence's worth (-4 to +4) still ranks the completions that stay in it.
MALFORMED_SCORE = -1.0

def _split(text):
    """text_logprob's reading of a text: its words (one space apart) cut after each "." into
    sentences. Returns (sentences, the words after the last ".")."""
    words, sentences = text.split(" "), []
    while "." in words:
        i = words.index(".") + 1
        sentences.append(words[:i])
        words = words[i:]
    return sentences, words

def _template(sentence):
    """The template (as a list of words and slots) that a sentence's words fill, or None."""
    return next((t for t in map(str.split, TEMPLATES)
                 if len(t) == len(sentence) and all(map(_fits, sentence, t))), None)

def true_reward(prompt, response):
    """The hidden reward, read sentence by sentence as text_logprob reads prompt + response: a
    sentence that fills a template earns its words' weights; one that does not (chained
    adjectives, a wrong slot word, junk, words left without a closing ".", the first word glued to
    the prompt's), and one past the MAX_SENTENCES-th of the whole text, earns MALFORMED_SCORE
    instead. An empty response ends the text at the prompt: 0 where the prompt is a text of its
    own (two sentences or more: the generator may stop there, and π_ref with it), MALFORMED_SCORE
    after one sentence. Every response the generator writes is in the language, so there it is the
    plain sum of its word weights. Labels the pairs and scores evaluations; DPO never calls it.
    The prompt's words do not count (for one prompt they would shift every completion's reward
    alike); its sentences do, towards MAX_SENTENCES."""
    body = response[1:] if response.startswith(" ") else response  # the space after the prompt
    start = len(_split(prompt)[0])
    if response == "":
        return 0.0 if start >= 2 else MALFORMED_SCORE
    sentences, rest = _split(body)
    sentences += [rest] * bool(rest)  # words without a period (or "" for a lone space)
    glued = bool(prompt) and not response.startswith(" ")
    return float(sum(sum(WEIGHTS.get(w, 0.0) for w in s)
                     if start + i < MAX_SENTENCES and not (glued and i == 0) and _template(s)
                     else MALFORMED_SCORE for i, s in enumerate(sentences)))

def in_language(prompt, response):
    """Whether a completion is one the task's generator could write after its prompt: prompt +
    response a text of the language (text_logprob finite; an empty response, where the prompt is
    one). For a prompt of the task, exactly the completions on which true_reward charges no
    MALFORMED_SCORE."""
    return math.isfinite(text_logprob(prompt + response))

def has_top_word(text):
    """Whether a text holds a top word (TOP_WORDS) as a word the hidden reward scores."""
    return not TOP_WORDS.isdisjoint(_words(text))

def top_word_rate(texts):
    """The share of texts (completions, responses) holding at least one top word: a count of
    completions, not of words, so an exploration table reads it as how often a policy shows the
    best behaviour, beside its true reward."""
    return sum(map(has_top_word, texts)) / len(texts)

def _fits(word, slot):
    if slot in NEUTRAL:
        return word in NEUTRAL[slot]
    if slot in SENTIMENT:
        return word in SENTIMENT[slot][0] or word in SENTIMENT[slot][1]
    return word == slot

def text_logprob(text, p_values=P_VALUES):
    """Exact log P(text) under the generator, marginal over the latent p (uniform over p_values):
    log sum_p P(p) * prod_slots P(word | p) * P(templates) * P(length); -inf off the language."""
    sentences, rest = _split(text)
    n = len(sentences)
    if rest or not 2 <= n <= MAX_SENTENCES:
        return -math.inf
    logq = (n - 2) * math.log(1 - P_STOP) + (math.log(P_STOP) if n < MAX_SENTENCES else 0.0)
    n_pos = n_neg = 0
    for s in sentences:
        tpl = _template(s)
        if tpl is None:
            return -math.inf
        logq -= math.log(len(TEMPLATES))
        for w, slot in zip(s, tpl):
            if slot in NEUTRAL:
                logq -= math.log(len(NEUTRAL[slot]))
            elif slot in SENTIMENT:
                pos, neg = SENTIMENT[slot]
                n_pos, n_neg = n_pos + (w in pos), n_neg + (w in neg)
                logq -= math.log(len(pos) if w in pos else len(neg))
    lp = [n_pos * math.log(p) + n_neg * math.log(1 - p) for p in p_values]
    m = max(lp)
    return logq + m + math.log(sum(math.exp(x - m) for x in lp) / len(p_values))

# Regimes of the task: one language and one hidden reward, four ways to draw the data.
# The default pairs come from the generator π_ref imitates, so offline pairs are on-distribution and
# show every behaviour; each other regime takes away one thing that online sampling may buy back.
# A regime's task lives in its own folder (task_dir: out/task-capped, out/task-shifted) with the
# same files, and the stages read it through their path flags, e.g. for capped (or unseen), whose
# π_ref is the default's: python reward.py --out_dir out/capped/reward --train_pairs
# out/task-capped/pairs_train.jsonl --val_pairs out/task-capped/pairs_val.jsonl, and likewise
# precompute.py, dpo.py and online_dpo.py; shifted needs its own sft.py run first.
REGIMES = {
    "default": "pairs drawn from the generator pi_ref imitates: on-distribution, every behaviour",
    "capped": "the pair pool holds no response whose true reward exceeds the cap; the texts, the "
              "prompts and so pi_ref are the default's",
    "unseen": "the pair pool holds no response with a top word (TOP_WORDS: great, superb, loved); "
              "the texts, the prompts and so pi_ref are the default's, and pi_ref emits them",
    "shifted": "the generator's latent sentiment is mostly negative (p in SHIFTED_P_VALUES): "
               "pi_ref's mode sits away from high reward, the pairs drawn from that same generator",
}
# The median true reward of the generator's responses: 0, since the reward's distribution is
# symmetric about 0 (P_VALUES and the word weights are) and has an atom there (neutral responses).
CAP = 0.0
# unseen: the rule is on responses only, the behaviour the labels can show. A pair's prompt keeps
# its top words (it is the default's, as the held-out prompts are, so π_ref is tested on the same
# openings); the hidden reward ignores the prompt.
REJECT = {"capped": lambda prompt, y: true_reward(prompt, y) > CAP,
          "unseen": lambda prompt, y: has_top_word(y)}
SHIFTED_P_VALUES = (0.1, 0.2, 0.3)  # uniform: 4 sentiment words in 5 are negative, not 1 in 2

def task_dir(regime):
    """Where a regime's task lives by default: out/task, else out/task-<regime>."""
    return "out/task" if regime == "default" else f"out/task-{regime}"

def check_regime(regime):
    if regime not in REGIMES:
        raise SystemExit(f"error: --regime {regime!r} is not a regime of the task: choose one of "
                         f"{', '.join(REGIMES)}")

def pool_rewards(rows):
    """The true reward of every response of a pair pool (rows {"prompt","chosen","rejected"}, both
    responses of each)."""
    return [true_reward(r["prompt"], r[k]) for r in rows for k in ("chosen", "rejected")]

def pool_best(rows):
    """The best behaviour a pair pool shows: the highest true reward of any of its responses. One
    number for the pool, not one per prompt: the hidden reward ignores the prompt, and held-out
    prompts are not in the pool."""
    return max(pool_rewards(rows))

def pool_quantile(rows, q):
    """The q-quantile of a pair pool's pool_rewards (numpy's linear interpolation): q 0.99 marks
    behaviour the pool shows rarely, where its best (q 1) may be one outlier."""
    return float(np.quantile(pool_rewards(rows), q))

def fraction_beyond(rewards, best):
    """The share of completions (their true rewards) beyond the pool's best: behaviour the pairs
    never showed, which only exploration, or extrapolation, can reach."""
    return sum(r > best for r in rewards) / len(rewards)

def build_task(out_dir="out/task", seed=0, regime="default"):
    """Generate the task into a temporary folder beside out_dir, then rename it into place."""
    check_regime(regime)
    out_dir = out_dir.rstrip("/")
    tmp = f"{out_dir}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    # a stream per file: resizing one changes no other
    rng = lambda name: random.Random(f"{seed}/{name}")  # noqa: E731
    p_values = SHIFTED_P_VALUES if regime == "shifted" else P_VALUES
    files = {}
    for name in ("sft_train", "sft_val"):
        r = rng(name)
        files[name] = [sample_text(r, p_values) for _ in range(SIZES[name])]
    for name in ("pairs_train", "pairs_val"):
        # a regime's redraws come from a stream of its own (pairs_train/capped, .../unseen)
        r, redraw = rng(name), rng(f"{name}/{regime}")
        files[name] = [sample_pair(r, p_values, REJECT.get(regime), redraw)
                       for _ in range(SIZES[name])]
    for name in ("prompts_train", "prompts_test", "prompts_val"):
        # the test prompts are the stream once named prompts_eval: the held-out set of earlier runs
        r = rng("prompts_eval" if name == "prompts_test" else name)
        files[name] = [dict(prompt=sample_prompt(r, p_values)[2]) for _ in range(SIZES[name])]
    # disjoint held-out sets: a validation prompt that is also a test prompt is drawn again (the
    # language is small: 22 of 200 were), so a setting chosen on validation saw no test prompt
    test, r = {x["prompt"] for x in files["prompts_test"]}, rng("prompts_val/disjoint")
    for x in files["prompts_val"]:
        while x["prompt"] in test:
            x["prompt"] = sample_prompt(r, p_values)[2]
    for name, rows in files.items():
        lines = rows if name.startswith("sft") else [json.dumps(row) for row in rows]
        ext = "txt" if name.startswith("sft") else "jsonl"
        atomic_write_text(os.path.join(tmp, f"{name}.{ext}"),
                          "".join(line + "\n" for line in lines))
    tok = data.train_tokenizer(files["sft_train"], vocab_size=512)
    data.save_tokenizer(tok, os.path.join(tmp, "tokenizer.json"))
    # The loss a perfect SFT model reaches on sft_val: tokenization is deterministic, so the
    # generator's log P(text) is the model's best sum of token log-probs; predicted tokens are the
    # text's and the EOS.
    n_tok = [len(tok.encode(t)) + 1 for t in files["sft_val"]]
    floor = -sum(text_logprob(t, p_values) for t in files["sft_val"]) / sum(n_tok)
    longest = lambda strings: max(  # noqa: E731
        len(e.ids) for e in tok.tk.encode_batch(strings, add_special_tokens=False))
    pairs = files["pairs_train"] + files["pairs_val"]
    meta = dict(seed=seed, counts={k: len(v) for k, v in files.items()},
                vocab_size=tok.vocab_size,
                floor_nats_per_token=floor,
                # with BOS/EOS, as the stages count: sizes for max_len and block_size
                max_tokens=dict(
                    sft_text=longest(files["sft_train"] + files["sft_val"]) + 2,
                    prompt=longest([r["prompt"] for r in pairs]) + 1,
                    response=longest([r[k] for r in pairs for k in ("chosen", "rejected")]) + 1),
                regime=regime, regime_rule=REGIMES[regime], p_values=list(p_values),
                cap=CAP if regime == "capped" else None,
                pool_best=pool_best(files["pairs_train"]),
                # what only exploration can reach: the pool's responses (train and val) against
                # the texts π_ref imitates; both shares of texts holding a top word
                top_words=sorted(TOP_WORDS),
                pool_top_word_rate=top_word_rate([r[k] for r in pairs
                                                  for k in ("chosen", "rejected")]),
                sft_top_word_rate=top_word_rate(files["sft_train"]))
    atomic_write_text(os.path.join(tmp, "task.json"), json.dumps(meta, indent=2) + "\n")
    old = f"{tmp}.old"
    if os.path.exists(out_dir):
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def ensure_task(out_dir="out/task", seed=0, log=print, regime="default"):
    """Build the task unless out_dir already holds it (for this seed and regime). Returns
    out_dir."""
    check_regime(regime)
    meta = os.path.join(out_dir, "task.json")
    if os.path.exists(meta):
        with open(meta) as f:
            found = json.load(f)
        # a task built before regimes were: the default
        found = (found["seed"], found.get("regime", "default"))
        if found != (seed, regime):
            raise ValueError(f"{out_dir} holds the task for seed {found[0]} and regime "
                             f"{found[1]}, not seed {seed} and regime {regime}: remove it or "
                             f"pick another folder")
        files = [f"{n}.{'txt' if n.startswith('sft') else 'jsonl'}" for n in SIZES]
        missing = [f for f in files if not os.path.exists(os.path.join(out_dir, f))]
        if not missing:
            return out_dir
        # an older version's task (before prompts_val): the seed rebuilds the same files and more
        log(f"{out_dir} lacks {', '.join(missing)} (an older version built it): rebuilding it")
    t0 = time.time()
    build_task(out_dir, seed, regime)
    log(f"built the task in {out_dir} (seed {seed}, regime {regime}, {time.time() - t0:.1f} s)")
    return out_dir


def require_task(paths, d, log):
    """plumbing.require_stage for inputs the built-in task writes: paths {path: its default}. With
    a default path, a missing file builds the whole task (rank 0 writes it, the others wait). An
    optional input (its default "") left empty is not required."""
    def build():
        if d.is_main:
            ensure_task()
        barrier(d)
    for path, default in paths.items():
        if path or default:
            require_stage(path, default, build, "python task.py", d, log)


def task_prompts(prompts):
    """True when the task's generator can write every prompt (whole sentences of its language):
    only there does its hidden true reward mean anything. A prompt of 1 to 4 sentences, doubled,
    is a text of 2 to 8, which text_logprob gives a finite log-probability."""
    return all(math.isfinite(text_logprob(f"{p} {p}")) for p in set(prompts))


def require_task_prompts(prompts, path, scorer):
    """A loop whose `scorer` (its labeller, --reward true or oracle) is the hidden true reward
    refuses prompts of another text (task_prompts), before it trains on a reward that means
    nothing there; path names the file."""
    check(task_prompts(prompts), f"{path}: {scorer} is the built-in task's hidden reward, which "
          "scores only the task's text: pass its prompts (out/task/prompts_*.jsonl)")


def task_pool_marks(prompts_path):
    """What the task's pair pool shows (pairs_train.jsonl beside task.json), read and scored once,
    as evaluate_policy's keywords: {"pool_best": its best response's true reward, "pool_p99":
    their 99th percentile}, when prompts_path is in a built-in task's folder; else {}."""
    folder = os.path.dirname(prompts_path)
    if not os.path.exists(os.path.join(folder, "task.json")):
        return {}
    rewards = pool_rewards(data.read_pairs(os.path.join(folder, "pairs_train.jsonl")))
    return {"pool_best": max(rewards), "pool_p99": float(np.quantile(rewards, 0.99))}


def task_pool_best(prompts_path):
    """task_pool_marks' pool_best, or None outside a built-in task's folder."""
    return task_pool_marks(prompts_path).get("pool_best")


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--regime", default="default",
                    help=f"one of {', '.join(REGIMES)} (default: default)")
    ap.add_argument("--seed", type=int, default=0, help="the task's seed (default: 0)")
    ap.add_argument("--out_dir", default="", help="default: out/task, or out/task-<regime>")
    a = ap.parse_args()
    folder = ensure_task(a.out_dir or task_dir(a.regime), a.seed, regime=a.regime)
    with open(os.path.join(folder, "task.json")) as f:
        print(f.read())
    for row in data.read_pairs(os.path.join(folder, "pairs_train.jsonl"))[:4]:
        rc, rr = (true_reward(row["prompt"], row[k]) for k in ("chosen", "rejected"))
        print(f"{row['prompt']!r}\n  chosen   {rc:+.1f} {row['chosen']!r}\n"
              f"  rejected {rr:+.1f} {row['rejected']!r}")
