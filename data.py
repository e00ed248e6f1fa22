"""
Everything the stages read: the tokenizer, the built-in task (a toy copy of the DPO paper's
controlled-sentiment experiment, with its hidden true reward), preference JSONL, tokenization with
an exact prompt/response boundary, batches of [chosen; rejected], and deterministic rank sharding.

    python data.py                   # build out/task if it is missing, then show a few pairs
    python data.py --regime capped   # a regime of the task: default, capped or shifted; here
                                     # out/task-capped (--out_dir to choose)
    python data.py --help            # --seed, --out_dir
    python data.py own my_pairs.jsonl --out out/own   # your own preference file: a tokenizer,
                                     # SFT text and the block that fits it (data.py own --help)
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
            raise ValueError(f"the tokenizer has no {EOS} token (every sequence uses it as BOS and "
                             f"EOS)")
        if tk.token_to_id(PAD) is None:  # e.g. GPT-2's tokenizer.json: PAD gets the next id, 50257
            tk.add_special_tokens([PAD])
        self.tk, self.eos, self.pad = tk, tk.token_to_id(EOS), tk.token_to_id(PAD)
        self.vocab_size = tk.get_vocab_size(with_added_tokens=True)

    def encode(self, text):
        return self.tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self.tk.decode(list(ids), skip_special_tokens=True)

def train_tokenizer(texts, vocab_size=512):
    """Byte-level BPE as GPT-2's: words keep their leading space (" great"), any string
    round-trips."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD],
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(texts, trainer)
    return Tok(tk)

def load_tokenizer(path):
    """A tokenizer.json as Tok; a file the tokenizers library cannot read, or one without the EOS
    token, is a DataError naming it (one line, no traceback)."""
    try:
        tk = Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises its own Exception type, with the parser's message
        raise DataError(f"{path}: not a tokenizer.json the tokenizers library can read "
                        f"({e})") from None
    try:
        return Tok(tk)
    except ValueError as e:
        raise DataError(f"{path}: {e}") from None

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
            raise ValueError(f"{out_dir} holds the task for seed {found[0]} and regime "
                             f"{found[1]}, not seed {seed} and regime {regime}: remove it or "
                             f"pick another folder")
        return out_dir
    t0 = time.time()
    build_task(out_dir, seed, regime)
    log(f"built the task in {out_dir} (seed {seed}, regime {regime}, {time.time() - t0:.1f} s)")
    return out_dir

# -----------------------------------------------------------------------------
# Reading user files. Every bad row is an error naming its file and line; nothing is dropped, or
# read as something else, silently.

class DataError(SystemExit):
    """A bad input file. The message starts with "path:line: ". A SystemExit, so that a user's
    mistake ends the run with that one line and no traceback (as plumbing.check does); tests catch
    it as usual."""

def _lines(path):
    """(line number, line) for each line that is not blank: blank lines are not rows. A UTF-8 BOM
    (some Windows editors write one) is not part of the first line."""
    try:
        f = open(path, "rb")
    except OSError as e:  # a directory, a missing or an unreadable file
        raise DataError(f"{path}: cannot read it ({e.strerror})") from None
    with f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8").rstrip("\r\n")
            except UnicodeDecodeError:
                raise DataError(f"{path}:{n}: not UTF-8 text") from None
            if line.strip():
                yield n, line

def _json_type(v):
    return {bool: "a boolean", int: "a number", float: "a number", list: "an array",
            dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)

def _json_row(path, n, line):
    def no_repeats(items):  # json.loads would keep a repeated key's last value: a silent misread
        keys = [k for k, _ in items]
        for k in keys:
            if keys.count(k) > 1:
                raise DataError(f'{path}:{n}: key "{k}" appears twice')
        return dict(items)
    try:
        row = json.loads(line, object_pairs_hook=no_repeats)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(row, dict):
        raise DataError(f"{path}:{n}: expected a JSON object, got {_json_type(row)}")
    return row

def _text(path, n, s, what):
    """s, unless it holds a lone surrogate escape ("\\ud83d", half an emoji: no character, and the
    tokenizer cannot encode it) or EOS or PAD as text (the tokenizer would read them as special)."""
    if re.search("[\ud800-\udfff]", s):
        raise DataError(f"{path}:{n}: {what} holds a lone surrogate escape (half a character)")
    for t in (EOS, PAD):
        if t in s:
            raise DataError(f"{path}:{n}: {what} contains {t}, which the tokenizer would read as "
                            f"its special token")
    return s

# Conversations (TRL's conversational format: lists of {"role", "content"} messages) become text
# by ONE fixed template, for pairs and SFT text alike: a line per message, "Role: content". A
# prompt ends with "\nAssistant:", so its response starts with a space, as every response here.
#     System: Answer briefly.        <- optional
#     User: Will it rain today?
#     Assistant: Probably not.
ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}

def render(messages):
    return "\n".join(f"{ROLES[m['role']]}: {m['content']}" for m in messages)

def _field(path, n, row, key):
    """row[key]: a string, or a non-empty list of messages the template renders."""
    if key not in row:
        raise DataError(f'{path}:{n}: missing field "{key}"')
    v = row[key]
    if isinstance(v, str):
        return _text(path, n, v, f'field "{key}"')
    if not isinstance(v, list) or not v:
        raise DataError(f'{path}:{n}: field "{key}" must be a string or a list of messages, got '
                        f'{"an empty array" if v == [] else _json_type(v)}')
    for i, m in enumerate(v):
        if (not isinstance(m, dict) or set(m) != {"role", "content"} or m["role"] not in list(ROLES)
                or not isinstance(m["content"], str)):
            raise DataError(f'{path}:{n}: {key}[{i}] is {json.dumps(m)[:50]}: the template renders '
                            f'{{"role": "system", "user" or "assistant", "content": a string}}')
        _text(path, n, m["content"], f"{key}[{i}]")
    return v

def _nonempty(path, rows, what):
    if not rows:
        raise DataError(f"{path}:1: no {what} (the file is empty)")
    return rows

def read_pairs(path):
    """Preference JSONL in TRL's formats: {"prompt", "chosen", "rejected"}, all strings or all lists
    of messages (rendered by the template); or an implicit prompt: only "chosen" and "rejected",
    full texts or conversations, whose prompt is what both begin with: the messages (as TRL's
    extract_prompt), or the text up to the last whitespace before they differ (TRL cuts at the
    first differing character; we never cut a word). A row with a prompt may hold other fields
    (ignored); one without holds nothing else: another key is likelier a misspelled "prompt"."""
    out = []
    for n, line in _lines(path):
        row = _json_row(path, n, line)
        extra = sorted(set(row) - {"chosen", "rejected"})
        if "prompt" not in row and extra:
            raise DataError(f'{path}:{n}: no "prompt" field but other fields ({", ".join(extra)}): '
                            f'a misspelled "prompt"? A row without one holds only the responses')
        p = _field(path, n, row, "prompt") if "prompt" in row else None
        c, r = _field(path, n, row, "chosen"), _field(path, n, row, "rejected")
        if len({type(v) for v in (p, c, r) if v is not None}) > 1:
            raise DataError(f"{path}:{n}: mixes strings and lists of messages")
        if c == r:
            raise DataError(f'{path}:{n}: "chosen" and "rejected" are identical')
        if isinstance(c, list):
            if p is None:  # the messages both begin with, as TRL's extract_prompt
                k = 0
                while k < min(len(c), len(r)) and c[k] == r[k]:
                    k += 1
                p, c, r = c[:k], c[k:], r[k:]
            if not p:
                raise DataError(f'{path}:{n}: no "prompt" field, and the conversations share no '
                                f'first message')
            if not c or not r or c[0]["role"] != "assistant" or r[0]["role"] != "assistant":
                raise DataError(f'{path}:{n}: "chosen" and "rejected" must each answer the prompt '
                                f'with an assistant message')
            x = render(p) + "\nAssistant:"
            p, c, r = x, render(p + c)[len(x):], render(p + r)[len(x):]
        for key, v in (("chosen", c), ("rejected", r)):
            if not v:
                raise DataError(f'{path}:{n}: field "{key}" is empty')
        if p is None:
            k = len(os.path.commonprefix([c, r]))
            cut = max((i for i in range(k) if c[i].isspace()), default=0)
            if cut == 0:
                raise DataError(f'{path}:{n}: no "prompt" field, and "chosen" and "rejected" share '
                                f'no prompt (no whitespace inside their common prefix)')
            p, c, r = c[:cut], c[cut:], r[cut:]
        out.append(dict(prompt=p, chosen=c, rejected=r))
    return _nonempty(path, out, "rows")

def read_prompts(path):
    """JSONL rows {"prompt": a string or messages} when the name ends in .jsonl (messages rendered
    as a prompt: the template, then a line "Assistant:"), else plain text, a prompt per line."""
    if path.endswith(".jsonl"):
        ps = [_field(path, n, _json_row(path, n, line), "prompt") for n, line in _lines(path)]
        return _nonempty(path, [p if isinstance(p, str) else render(p) + "\nAssistant:"
                                for p in ps], "prompts")
    return _nonempty(path, [_text(path, n, s, "the line") for n, s in _lines(path)], "prompts")

def read_texts(path):
    """SFT text: JSONL rows {"text": str} or {"messages": [...]} (rendered by the template) when
    the name ends in .jsonl (a text may then hold newlines), else plain text, a text per line."""
    if not path.endswith(".jsonl"):
        return _nonempty(path, [_text(path, n, s, "the line") for n, s in _lines(path)], "texts")
    out = []
    for n, line in _lines(path):
        row = _json_row(path, n, line)
        if "text" in row and "messages" in row:
            raise DataError(f'{path}:{n}: both "text" and "messages": which one is the text?')
        v = _field(path, n, row, "messages" if "messages" in row else "text")
        out.append(v if isinstance(v, str) else render(v))
    return _nonempty(path, out, "texts")

# -----------------------------------------------------------------------------
# Token sequences. Prompt and response are tokenized apart, so the boundary is exact whatever the
# tokenizer would merge across it; every sequence starts with EOS as BOS (as GPT-2's <|endoftext|>).

def encode_prompt(tok, prompt):
    return [tok.eos] + tok.encode(prompt)

def encode_response(tok, response):
    return tok.encode(response) + [tok.eos]

def truncate_prompt(ids, n):
    """A prompt's ids (BOS first) cut to at most n tokens: its BOS and its last n - 1 tokens, the
    words nearest the response. The one rule of every stage that samples from a prompt (ppo.py,
    evaluate.py, reward.py's offset); tokenize_pairs cuts pairs' prompts the same way."""
    assert n >= 2, f"a prompt keeps its BOS and at least one token, not n={n}"
    return ids if len(ids) <= n else ids[:1] + ids[len(ids) - n + 1:]

def tokenize_pairs(tok, rows, max_len, max_prompt_len):
    """Rows {"prompt","chosen","rejected"} -> examples dict(index, prompt, chosen, rejected) of
    token ids, index = the row's position in rows (the reference log-prob cache key), and stats.
    Our truncation, when len(prompt) + len(longer response) > max_len (all counts with BOS/EOS):
      1. the prompt keeps its BOS and its last tokens, max(max_len - len(longer response),
         max_prompt_len) in all: cut only as much as needed, never below max_prompt_len;
      2. then each response keeps its first max_len - len(prompt) tokens (a cut response loses its
         EOS: it did not end). At least max_len - max_prompt_len >= 1 tokens of each are left.
    (TRL 1.16's DPOTrainer has no prompt limit: it keeps the first max_length tokens of prompt +
    response, truncation_mode="keep_start", and drops a pair whose prompt alone fills them.)
    A row whose two responses become identical teaches nothing (unusable): left out and counted.
    stats = {"rows", "truncated_prompt", "truncated_response", "unusable"}."""
    assert 2 <= max_prompt_len < max_len, \
        f"need 2 <= max_prompt_len ({max_prompt_len}) < max_len ({max_len})"
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
    # stats["chosen_lost_eos"], stats["rejected_lost_eos"]: usable pairs whose chosen (rejected)
    # response was cut, so lost its EOS; counted per side, as an uneven cut is learned
    for k in ("chosen", "rejected"):
        stats[f"{k}_lost_eos"] = sum(e[k][-1] != tok.eos for e in examples)
    return examples, stats

# truncation_warning speaks when more than this fraction of the rows lose tokens
HEAVY_CUT = 0.05

def truncation_warning(stats, path, max_len, fix):
    """A loud warning from tokenize_pairs' stats, "" when there is nothing to say. Heavy: more than
    HEAVY_CUT of the rows have their prompt, or a response, cut. Uneven: the c chosen and r rejected
    responses that lost their EOS differ by more than 2·sqrt(c + r), two standard deviations of a
    fair split of c + r cut responses between the sides. A cut response is one that never ended,
    and training learns whatever the cut favours: where chosen responses are the longer ones
    (helpful answers), DPO and r_φ learn to prefer responses that do not stop. `fix` says what the
    stage's user can do about it."""
    n, c, r = stats["rows"], stats["chosen_lost_eos"], stats["rejected_lost_eos"]
    heavy = max(stats["truncated_prompt"], stats["truncated_response"]) > HEAVY_CUT * n
    uneven = abs(c - r) > 2 * math.sqrt(c + r)
    if not (heavy or uneven):
        return ""
    how = " and ".join(w for w, bad in (("heavily", heavy), ("unevenly", uneven)) if bad)
    return (f"WARNING: truncation to {max_len} tokens cuts {path} {how}: "
            f"{stats['truncated_prompt']} of {n} prompts and {stats['truncated_response']} of {n} "
            f"pairs' responses cut; {c} chosen and {r} rejected responses lost their EOS. A cut "
            f"response reads as one that never ends, and training learns whatever the cut "
            f"favours. {fix}")

def tokenize_texts(tok, texts, max_len):
    """SFT examples dict(index, prompt=[eos], response=encode(text) + [eos]), the response cut from
    the right to max_len - 1 tokens. stats = {"rows", "truncated"}."""
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
        # position t predicts token t+1
        targets[i, len(x) - 1:len(x) + len(y) - 1] = torch.tensor(y)
    return ids, targets

def collate_pairs(examples, pad_id):
    """B examples -> dict(input_ids (2B,T), targets (2B,T), index (B,) long): rows
    [chosen_0..chosen_{B-1}; rejected_0..rejected_{B-1}], so one forward scores both halves."""
    ids, targets = collate([(e["prompt"], e["chosen"]) for e in examples] +
                           [(e["prompt"], e["rejected"]) for e in examples], pad_id)
    return dict(input_ids=ids, targets=targets, index=torch.tensor([e["index"] for e in examples]))

# -----------------------------------------------------------------------------
# Rank sharding: the global batch at a step depends on (n, batch_size, step, seed, lengths) only,
# so any world size trains on the same data in the same order, and a resumed run continues where it
# stopped.

def longest_row(example):
    """Tokens of the longest row an example puts in a batch: its prompt and its longer response (a
    pair: [chosen; rejected] are padded together) or its response (a text)."""
    return len(example["prompt"]) + max(len(example[k]) for k in ("chosen", "rejected", "response")
                                        if k in example)

def global_batch(n, batch_size, step, seed, lengths=None):
    """Indices of the global batch at step: epoch-wise permutation, incomplete tail dropped.
    With lengths (one per example, e.g. longest_row), the same batch sorted by length, longest
    first (ties keep their random order): every micro-batch cut from it, and every rank's share of
    it (both contiguous), then holds rows of about one length and is padded only to its own longest.
    The batch is still a uniform sample of the data: the step's loss and gradient are the unsorted
    batch's (up to the order of fp32 sums); only the padding drops.
    Not Hugging Face's group_by_length, which sorts windows of many batches by length, so that a
    batch holds only similar lengths: that saves more padding but changes training. Measured here,
    with windows of 8 batches: the reward model's held-out accuracy after its 120 steps fell from
    0.820 to 0.678 and its correlation with the true reward from 0.82 to 0.47 (it learned from
    batches of one length, where the sum-of-words reward barely varies)."""
    per_epoch = n // batch_size
    assert per_epoch >= 1, f"batch size {batch_size} is larger than the data ({n} examples)"
    epoch, i = divmod(step, per_epoch)
    batch = np.random.default_rng(seed + epoch).permutation(n)[i * batch_size:(i + 1) * batch_size]
    if lengths is not None:
        assert len(lengths) == n, f"{len(lengths)} lengths for {n} examples"
        batch = batch[np.argsort(-np.asarray(lengths)[batch], kind="stable")]
    return batch.tolist()

def rank_slice(indices, rank, world):
    """This rank's contiguous share of the global batch; the shares are disjoint and cover it."""
    assert len(indices) % world == 0, \
        f"global batch {len(indices)} is not divisible by world size {world}"
    k = len(indices) // world
    return indices[rank * k:(rank + 1) * k]

# -----------------------------------------------------------------------------
# Your own preference file alone, the data side: as the DPO paper does when no SFT model exists
# (Rafailov et al. 2023, sec. 4: π_ref maximises the likelihood of the preferred completions),
# a tokenizer trained on your text, SFT text of prompt + chosen, and the block that fits them.
#     python data.py own examples/dialogue_pairs.jsonl --out out/own

def own_data(pairs, out_dir, vocab_size=1024, block_size=0, val_frac=0.1, seed=0, log=print):
    """Writes out_dir/: pairs_{train,val}.jsonl (the rows of `pairs` as strings, a seeded val_frac
    held out), sft_{train,val}.jsonl ({"text": prompt + chosen}), prompts_eval.jsonl (the held-out
    prompts), tokenizer.json (byte-level BPE on the train rows). Returns block_size, or (0) the
    smallest that fits every pair (prompt + longer response, BOS and EOS), logging what it cuts."""
    rows = read_pairs(pairs)
    if len(rows) < 2:
        raise DataError(f"{pairs}:1: one row: nothing to hold out for validation")
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    n_val = min(len(rows) - 1, max(1, round(val_frac * len(rows))))
    split = dict(train=[rows[i] for i in sorted(order[n_val:])],
                 val=[rows[i] for i in sorted(order[:n_val])])
    tok = train_tokenizer([r["prompt"] + r[k] for r in split["train"]
                           for k in ("chosen", "rejected")], vocab_size)
    os.makedirs(out_dir, exist_ok=True)
    save_tokenizer(tok, os.path.join(out_dir, "tokenizer.json"))
    jsonl = lambda objs: "".join(json.dumps(o, ensure_ascii=False) + "\n" for o in objs)
    for name, rs in split.items():
        _atomic_write(os.path.join(out_dir, f"pairs_{name}.jsonl"), jsonl(rs))
        _atomic_write(os.path.join(out_dir, f"sft_{name}.jsonl"),
                      jsonl({"text": r["prompt"] + r["chosen"]} for r in rs))
    _atomic_write(os.path.join(out_dir, "prompts_eval.jsonl"),
                  jsonl({"prompt": r["prompt"]} for r in split["val"]))
    n_tok = [(len(encode_prompt(tok, r["prompt"])), len(encode_response(tok, r["chosen"])),
              len(encode_response(tok, r["rejected"]))) for r in rows]
    longest = max(x + max(yc, yr) for x, yc, yr in n_tok)
    block = block_size or longest
    ex, st = tokenize_pairs(tok, rows, block, block // 2)  # a cut prompt keeps half the block
    _, sft = tokenize_texts(tok, [r["prompt"] + r["chosen"] for r in rows], block)
    lost = [sum(e[k][-1] != tok.eos for e in ex) for k in ("chosen", "rejected")]
    chars, N = sum(len(r["prompt"] + r["chosen"] + r["rejected"]) for r in rows), len(rows)
    log(f"{out_dir}: {len(split['train'])} train and {n_val} val pairs of {pairs}, a tokenizer of "
        f"{tok.vocab_size} tokens ({chars / sum(map(sum, n_tok)):.1f} characters per token)\n"
        f"block_size {block} (the longest pair is {longest} tokens with BOS and EOS), "
        f"max_prompt_len {block // 2}: {st['truncated_prompt']} of {N} prompts and "
        f"{st['truncated_response']} of {N} pairs' responses cut (EOS lost: {lost[0]} chosen, "
        f"{lost[1]} rejected), {st['unusable']} unusable, {sft['truncated']} of {N} SFT texts cut")
    log("next: π_ref by SFT on prompt + chosen, then DPO (which builds its reference cache):\n" +
        "\n".join("    " + c for c in own_commands(out_dir, block, len(split["train"]))))
    return block


def own_commands(out_dir, block, n_train):
    """sft.py's and dpo.py's command lines for own_data's folder: the block that fits, and a batch
    no larger than the train rows (a power of two, so it splits into micro-batches) where sft.py's
    default 32 texts or dpo.py's 64 pairs would not fit."""
    o = lambda name: os.path.join(out_dir, name)  # noqa: E731
    batch = lambda default: (f" --batch_size {2 ** (n_train.bit_length() - 1)}"  # noqa: E731
                             if n_train < default else "")
    return [f"python sft.py --train_text {o('sft_train.jsonl')} --val_text {o('sft_val.jsonl')} "
            f"--tokenizer {o('tokenizer.json')} --block_size {block}{batch(32)} "
            f"--out_dir {o('sft')}",
            f"python dpo.py --ref_model {o('sft/model.safetensors')} --train_pairs "
            f"{o('pairs_train.jsonl')} --val_pairs {o('pairs_val.jsonl')} --eval_prompts "
            f"{o('prompts_eval.jsonl')} --max_len {block} --max_prompt_len {block // 2}"
            f"{batch(64)} --out_dir {o('dpo')}"]

if __name__ == "__main__":
    import argparse
    import sys
    if sys.argv[1:2] == ["own"]:
        ap = argparse.ArgumentParser(prog="python data.py own", description=own_data.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
        ap.add_argument("pairs", help="your preference JSONL")
        ap.add_argument("--out", default="out/own", help="the folder to write")
        ap.add_argument("--vocab_size", type=int, default=1024, help="the tokenizer's")
        ap.add_argument("--block_size", type=int, default=0, help="0: fit the longest pair")
        a = ap.parse_args(sys.argv[2:])
        own_data(a.pairs, a.out, a.vocab_size, a.block_size)
        sys.exit()
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
