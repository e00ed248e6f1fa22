"""
Everything the stages read: the tokenizer, the built-in task (a toy copy of the DPO paper's
controlled-sentiment experiment, with its hidden true reward), preference JSONL, tokenization with an
exact prompt/response boundary, batches of [chosen; rejected], and deterministic rank sharding.

    python data.py                   # build out/task if it is missing, then show a few of its pairs
    python data.py --regime capped   # a regime of the task: default, capped or shifted; here
                                     # out/task-capped (--out_dir to choose)
    python data.py --help            # --seed, --out_dir
"""
import json
import math
import os
import random
import re
import shutil
import time

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# -----------------------------------------------------------------------------
# Tokenizer

EOS, PAD = "<|endoftext|>", "<|pad|>"  # distinct: PAD == EOS would teach a policy never to stop

class Tok:
    """A tokenizers.Tokenizer and the two ids every stage needs. encode adds no special tokens."""
    def __init__(self, tk):
        if tk.token_to_id(EOS) is None:
            raise ValueError(f"the tokenizer has no {EOS} token (every sequence uses it as BOS and EOS)")
        if tk.token_to_id(PAD) is None:  # e.g. GPT-2's tokenizer.json: PAD gets the next id, 50257
            tk.add_special_tokens([PAD])
        self.tk, self.eos, self.pad = tk, tk.token_to_id(EOS), tk.token_to_id(PAD)
        self.vocab_size = tk.get_vocab_size(with_added_tokens=True)

    def encode(self, text):
        return self.tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self.tk.decode(list(ids), skip_special_tokens=True)

def train_tokenizer(texts, vocab_size=512):
    """Byte-level BPE as GPT-2's: words keep their leading space (" great"), any string round-trips."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(texts, trainer)
    return Tok(tk)

def load_tokenizer(path):
    return Tok(Tokenizer.from_file(path))

def save_tokenizer(tok, path):
    _atomic_write(path, tok.tk.to_str(pretty=True))

def _atomic_write(path, text):
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(path + ".tmp", path)  # readers see the old file or the new one, never half of one

# -----------------------------------------------------------------------------
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
P_VALUES = (0.1, 0.3, 0.5, 0.7, 0.9)  # the latent sentiment, uniform
P_STOP = 0.35                         # after each sentence from the 2nd on: memoryless length
MAX_SENTENCES = 8                     # so every text fits a 64-token context with BOS and EOS
SIZES = dict(sft_train=20000, sft_val=1000, pairs_train=4000, pairs_val=500,
             prompts_train=2000, prompts_eval=200)

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

def sample_pair(rng, p_values=P_VALUES, cap=None, redraw=None):
    """Two continuations of one prompt by the same generator (same latent p), labelled by
    Bradley-Terry on the hidden reward: chosen is the first with probability sigmoid(r1 - r2).
    With a cap (the capped regime), a response whose reward exceeds it is redrawn from the `redraw`
    stream until it does not: rejection sampling, so each response is the generator's, conditioned
    on reward <= cap (and the two distinct). The prompt and the label's uniform come from `rng`
    first, so a pair that was under the cap anyway is the uncapped pair, byte for byte."""
    p, k, prompt = sample_prompt(rng, p_values)
    a = b = ""
    while a == b:
        # responses start with the space
        a, b = (" " + " ".join(_sentences(rng, p, k)) for _ in range(2))
    u = rng.random()
    if cap is not None:
        while true_reward(prompt, a) > cap:
            a = " " + " ".join(_sentences(redraw, p, k))
        while true_reward(prompt, b) > cap or b == a:
            b = " " + " ".join(_sentences(redraw, p, k))
    if u >= 1 / (1 + math.exp(true_reward(prompt, b) - true_reward(prompt, a))):
        a, b = b, a
    return dict(prompt=prompt, chosen=a, rejected=b)

def true_reward(prompt, response):
    """The hidden reward: the sum of the response's word weights (unknown words and junk score 0).
    Labels the pairs and scores evaluations; DPO never calls it. The prompt does not count: for one
    prompt it would shift every completion's reward by the same amount."""
    return float(sum(WEIGHTS.get(w, 0.0) for w in re.findall(r"[a-z]+", response.lower())))

def _fits(word, slot):
    if slot in NEUTRAL:
        return word in NEUTRAL[slot]
    if slot in SENTIMENT:
        return word in SENTIMENT[slot][0] or word in SENTIMENT[slot][1]
    return word == slot

def text_logprob(text, p_values=P_VALUES):
    """Exact log P(text) under the generator, marginal over the latent p (uniform over p_values):
    log sum_p P(p) * prod_slots P(word | p) * P(templates) * P(length); -inf off the language."""
    words, sentences = text.split(" "), []
    while words and "." in words:
        i = words.index(".") + 1
        sentences.append(words[:i])
        words = words[i:]
    n = len(sentences)
    if words or not 2 <= n <= MAX_SENTENCES:
        return -math.inf
    logq = (n - 2) * math.log(1 - P_STOP) + (math.log(P_STOP) if n < MAX_SENTENCES else 0.0)
    n_pos = n_neg = 0
    for s in sentences:
        tpl = next((t for t in map(str.split, TEMPLATES)
                    if len(t) == len(s) and all(map(_fits, s, t))), None)
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

# Regimes of the task (issue 9): one language and one hidden reward, three ways to draw the data.
# The default pairs come from the generator π_ref imitates, so offline pairs are on-distribution and
# show every behaviour; each other regime takes away one thing that online sampling may buy back.
# A regime's task lives in its own folder (task_dir: out/task-capped, out/task-shifted) with the
# same files, and the stages read it through their path flags, e.g. for capped, whose π_ref is the
# default's: python reward.py --out_dir out/capped/reward --train_pairs
# out/task-capped/pairs_train.jsonl --val_pairs out/task-capped/pairs_val.jsonl, and likewise
# precompute.py, dpo.py and online_dpo.py; shifted needs its own sft.py run first.
REGIMES = {
    "default": "pairs drawn from the generator pi_ref imitates: on-distribution, every behaviour",
    "capped": "the pair pool holds no response whose true reward exceeds the cap; the texts, the "
              "prompts and so pi_ref are the default's",
    "shifted": "the generator's latent sentiment is mostly negative (p in SHIFTED_P_VALUES): "
               "pi_ref's mode sits away from high reward, the pairs drawn from that same generator",
}
# The median true reward of the generator's responses: 0, since the reward's distribution is
# symmetric about 0 (P_VALUES and the word weights are) and has an atom there (neutral responses).
CAP = 0.0
SHIFTED_P_VALUES = (0.1, 0.2, 0.3)  # uniform: 4 sentiment words in 5 are negative, not 1 in 2

def task_dir(regime):
    """Where a regime's task lives by default: out/task, out/task-capped, out/task-shifted."""
    return "out/task" if regime == "default" else f"out/task-{regime}"

def check_regime(regime):
    if regime not in REGIMES:
        raise SystemExit(f"error: --regime {regime!r} is not a regime of the task: choose one of "
                         f"{', '.join(REGIMES)}")

def pool_best(rows):
    """The best behaviour a pair pool shows: the highest true reward of any of its responses (rows
    {"prompt","chosen","rejected"}). One number for the pool, not one per prompt: the hidden reward
    ignores the prompt, and held-out prompts are not in the pool."""
    return max(true_reward(r["prompt"], r[k]) for r in rows for k in ("chosen", "rejected"))

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
    pv = SHIFTED_P_VALUES if regime == "shifted" else P_VALUES
    cap = CAP if regime == "capped" else None
    data = {}
    for name in ("sft_train", "sft_val"):
        r = rng(name)
        data[name] = [sample_text(r, pv) for _ in range(SIZES[name])]
    for name in ("pairs_train", "pairs_val"):
        r, redraw = rng(name), rng(f"{name}/capped")
        data[name] = [sample_pair(r, pv, cap, redraw) for _ in range(SIZES[name])]
    for name in ("prompts_train", "prompts_eval"):
        r = rng(name)
        data[name] = [dict(prompt=sample_prompt(r, pv)[2]) for _ in range(SIZES[name])]
    for name, rows in data.items():
        lines = rows if name.startswith("sft") else [json.dumps(row) for row in rows]
        ext = "txt" if name.startswith("sft") else "jsonl"
        _atomic_write(os.path.join(tmp, f"{name}.{ext}"), "".join(line + "\n" for line in lines))
    tok = train_tokenizer(data["sft_train"], vocab_size=512)
    save_tokenizer(tok, os.path.join(tmp, "tokenizer.json"))
    # The loss a perfect SFT model reaches on sft_val: tokenization is deterministic, so the
    # generator's log P(text) is the model's best sum of token log-probs; predicted tokens are the
    # text's and the EOS.
    n_tok = [len(tok.encode(t)) + 1 for t in data["sft_val"]]
    floor = -sum(text_logprob(t, pv) for t in data["sft_val"]) / sum(n_tok)
    longest = lambda strings: max(  # noqa: E731
        len(e.ids) for e in tok.tk.encode_batch(strings, add_special_tokens=False))
    pairs = data["pairs_train"] + data["pairs_val"]
    meta = dict(seed=seed, counts={k: len(v) for k, v in data.items()}, vocab_size=tok.vocab_size,
                floor_nats_per_token=floor,
                # with BOS/EOS, as the stages count: sizes for max_len and block_size
                max_tokens=dict(
                    sft_text=longest(data["sft_train"] + data["sft_val"]) + 2,
                    prompt=longest([r["prompt"] for r in pairs]) + 1,
                    response=longest([r[k] for r in pairs for k in ("chosen", "rejected")]) + 1),
                regime=regime, regime_rule=REGIMES[regime], p_values=list(pv), cap=cap,
                pool_best=pool_best(data["pairs_train"]))
    _atomic_write(os.path.join(tmp, "task.json"), json.dumps(meta, indent=2) + "\n")
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
            raise ValueError(f"{out_dir} holds the task for seed {found[0]} and regime {found[1]}, "
                             f"not seed {seed} and regime {regime}: remove it or pick another folder")
        return out_dir
    t0 = time.time()
    build_task(out_dir, seed, regime)
    log(f"built the task in {out_dir} (seed {seed}, regime {regime}, {time.time() - t0:.1f} s)")
    return out_dir

# -----------------------------------------------------------------------------
# Reading user files. Every bad row is an error naming its file and line; nothing is dropped silently.

class DataError(SystemExit):
    """A bad input file. The message starts with "path:line: ". A SystemExit, so that a user's mistake
    ends the run with that one line and no traceback (as plumbing.check does); tests catch it as usual."""

def _lines(path):
    """(line number, line) for each line that is not blank: blank lines are not rows."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError:
                raise DataError(f"{path}:{n}: not UTF-8 text") from None
            if line.strip():
                yield n, line

def _json_type(v):
    return {bool: "a boolean", int: "a number", float: "a number", list: "an array", dict: "an object",
            type(None): "null"}.get(type(v), type(v).__name__)

def _json_row(path, n, line):
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(row, dict):
        raise DataError(f"{path}:{n}: expected a JSON object, got {_json_type(row)}")
    return row

def _field(path, n, row, key):
    if key not in row:
        raise DataError(f'{path}:{n}: missing field "{key}"')
    if not isinstance(row[key], str):
        raise DataError(f'{path}:{n}: field "{key}" must be a string, got {_json_type(row[key])}')
    return row[key]

def _nonempty(path, rows, what):
    if not rows:
        raise DataError(f"{path}:1: no {what} (the file is empty)")
    return rows

def read_pairs(path):
    """Preference JSONL, one row per line: {"prompt", "chosen", "rejected"} strings (other fields are
    ignored), or only full "chosen" and "rejected" texts sharing a prompt: then the prompt is their
    common prefix up to its last whitespace, and the responses start with that whitespace (as TRL's
    extract_prompt: words both responses begin with stay in them only if no whitespace follows)."""
    out = []
    for n, line in _lines(path):
        row = _json_row(path, n, line)
        p = _field(path, n, row, "prompt") if "prompt" in row else None
        c, r = _field(path, n, row, "chosen"), _field(path, n, row, "rejected")
        for key, v in (("chosen", c), ("rejected", r)):
            if not v:
                raise DataError(f'{path}:{n}: field "{key}" is empty')
        if c == r:
            raise DataError(f'{path}:{n}: "chosen" and "rejected" are identical')
        if p is None:
            k = len(os.path.commonprefix([c, r]))
            cut = max((i for i in range(k) if c[i].isspace()), default=0)
            if cut == 0:
                raise DataError(f'{path}:{n}: no "prompt" field, and "chosen" and "rejected" share no '
                                f'prompt (no whitespace inside their common prefix)')
            p, c, r = c[:cut], c[cut:], r[cut:]
        out.append(dict(prompt=p, chosen=c, rejected=r))
    return _nonempty(path, out, "rows")

def read_prompts(path):
    """JSONL rows {"prompt": str} when the name ends in .jsonl, else plain text, a prompt per line."""
    if path.endswith(".jsonl"):
        return _nonempty(path, [_field(path, n, _json_row(path, n, line), "prompt")
                                for n, line in _lines(path)], "prompts")
    return _nonempty(path, [line for _, line in _lines(path)], "prompts")

def read_texts(path):
    """Plain text, one text per line."""
    return _nonempty(path, [line for _, line in _lines(path)], "texts")

# -----------------------------------------------------------------------------
# Token sequences. Prompt and response are tokenized apart, so the boundary is exact whatever the
# tokenizer would merge across it; every sequence starts with EOS as BOS (as GPT-2's <|endoftext|>).

def encode_prompt(tok, prompt):
    return [tok.eos] + tok.encode(prompt)

def encode_response(tok, response):
    return tok.encode(response) + [tok.eos]

def tokenize_pairs(tok, rows, max_len, max_prompt_len):
    """Rows {"prompt","chosen","rejected"} -> examples dict(index, prompt, chosen, rejected) of token ids,
    index = the row's position in rows (the reference log-prob cache key), and stats.
    Truncation, when len(prompt) + len(longer response) > max_len (all counts with BOS/EOS):
      1. the prompt keeps its BOS and its last tokens, max(max_len - len(longer response), max_prompt_len)
         in all (cut only as much as needed, never below max_prompt_len; TRL cuts to max_prompt_len);
      2. then each response keeps its first max_len - len(prompt) tokens (a cut response loses its EOS:
         it did not end). At least max_len - max_prompt_len >= 1 tokens of each are left.
    A row whose two responses become identical teaches nothing (unusable): left out and counted.
    stats = {"rows", "truncated_prompt", "truncated_response", "unusable"}."""
    assert 2 <= max_prompt_len < max_len, f"need 2 <= max_prompt_len ({max_prompt_len}) < max_len ({max_len})"
    stats = dict(rows=len(rows), truncated_prompt=0, truncated_response=0, unusable=0)
    examples = []
    for i, row in enumerate(rows):
        x = encode_prompt(tok, row["prompt"])
        yc, yr = encode_response(tok, row["chosen"]), encode_response(tok, row["rejected"])
        L = max(len(yc), len(yr))
        if len(x) + L > max_len:
            keep = max(max_len - L, max_prompt_len)
            if len(x) > keep:
                x = x[:1] + x[len(x) - keep + 1:]
                stats["truncated_prompt"] += 1
            room = max_len - len(x)
            if L > room:
                yc, yr = yc[:room], yr[:room]
                stats["truncated_response"] += 1
        if yc == yr:
            stats["unusable"] += 1
            continue
        examples.append(dict(index=i, prompt=x, chosen=yc, rejected=yr))
    return examples, stats

def tokenize_texts(tok, texts, max_len):
    """SFT examples dict(index, prompt=[eos], response=encode(text) + [eos]), the response cut from the
    right to max_len - 1 tokens. stats = {"rows", "truncated"}."""
    stats, examples = dict(rows=len(texts), truncated=0), []
    for i, text in enumerate(texts):
        y = encode_response(tok, text)
        if 1 + len(y) > max_len:
            y = y[:max_len - 1]
            stats["truncated"] += 1
        examples.append(dict(index=i, prompt=[tok.eos], response=y))
    return examples, stats

def collate(pairs_of_prompt_response, pad_id):
    """[(prompt ids, response ids)] -> input_ids (N,T) right-padded with pad_id, and targets (N,T):
    targets[t] = input_ids[t+1] where that token is a response token, else -100 (prompt, padding,
    last column). Right padding keeps every real token at its unpadded position (no mask needed)."""
    N, T = len(pairs_of_prompt_response), max(len(x) + len(y) for x, y in pairs_of_prompt_response)
    ids = torch.full((N, T), pad_id, dtype=torch.long)
    targets = torch.full((N, T), -100, dtype=torch.long)
    for i, (x, y) in enumerate(pairs_of_prompt_response):
        assert len(x) >= 1, "a prompt holds at least the BOS"
        ids[i, :len(x) + len(y)] = torch.tensor(x + y)
        targets[i, len(x) - 1:len(x) + len(y) - 1] = torch.tensor(y)  # position t predicts token t+1
    return ids, targets

def collate_pairs(examples, pad_id):
    """B examples -> dict(input_ids (2B,T), targets (2B,T), index (B,) long): rows
    [chosen_0..chosen_{B-1}; rejected_0..rejected_{B-1}], so one forward scores both halves."""
    ids, targets = collate([(e["prompt"], e["chosen"]) for e in examples] +
                           [(e["prompt"], e["rejected"]) for e in examples], pad_id)
    return dict(input_ids=ids, targets=targets, index=torch.tensor([e["index"] for e in examples]))

# -----------------------------------------------------------------------------
# Rank sharding: the global batch at a step depends on (n, batch_size, step, seed) only, so any world
# size trains on the same data in the same order, and a resumed run continues where it stopped.

def global_batch(n, batch_size, step, seed):
    """Indices of the global batch at step: epoch-wise permutation, incomplete tail dropped."""
    per_epoch = n // batch_size
    assert per_epoch >= 1, f"batch size {batch_size} is larger than the data ({n} examples)"
    epoch, i = divmod(step, per_epoch)
    perm = np.random.default_rng(seed + epoch).permutation(n)
    return perm[i * batch_size:(i + 1) * batch_size].tolist()

def rank_slice(indices, rank, world):
    """This rank's contiguous share of the global batch; the shares are disjoint and cover it."""
    assert len(indices) % world == 0, f"global batch {len(indices)} is not divisible by world size {world}"
    k = len(indices) // world
    return indices[rank * k:(rank + 1) * k]

if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--regime", default="default",
                    help=f"one of {', '.join(REGIMES)} (default: default)")
    ap.add_argument("--seed", type=int, default=0, help="the task's seed (default: 0)")
    ap.add_argument("--out_dir", default="", help="default: out/task, or out/task-<regime>")
    a = ap.parse_args()
    d = ensure_task(a.out_dir or task_dir(a.regime), a.seed, regime=a.regime)
    with open(os.path.join(d, "task.json")) as f:
        print(f.read())
    for row in read_pairs(os.path.join(d, "pairs_train.jsonl"))[:4]:
        rc, rr = (true_reward(row["prompt"], row[k]) for k in ("chosen", "rejected"))
        print(f"{row['prompt']!r}\n  chosen   {rc:+.1f} {row['chosen']!r}\n"
              f"  rejected {rr:+.1f} {row['rejected']!r}")
