"""Everything the stages read, from the user's files or the built-in task's (the same schema): the
tokenizer, preference JSONL, prompts and SFT text, each validated row by row, tokenization with an
exact prompt/response boundary, batches of [chosen; rejected], and deterministic rank sharding.

    python data.py own my_pairs.jsonl --out out/own   # your own preference file: a tokenizer,
                                     # SFT text and the block that fits it (data.py own --help)
"""
import json
import math
import os
import random
import re

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from model import IGNORE
from plumbing import atomic_write_text

# -----------------------------------------------------------------------------
# Tokenizer

EOS, PAD = "<|endoftext|>", "<|pad|>"  # distinct: PAD == EOS would teach a policy never to stop

class Tok:
    """A tokenizers.Tokenizer and the two ids every stage needs. encode adds no special tokens."""
    def __init__(self, tk):
        if tk.token_to_id(EOS) is None:
            raise ValueError(f"the tokenizer has no {EOS} token (every sequence's BOS and EOS)")
        if tk.token_to_id(PAD) is None:  # e.g. GPT-2's tokenizer.json: PAD gets the next id, 50257
            tk.add_special_tokens([PAD])
        self.tk, self.eos, self.pad = tk, tk.token_to_id(EOS), tk.token_to_id(PAD)
        self.vocab_size = tk.get_vocab_size(with_added_tokens=True)

    def encode(self, text):
        return self.tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self.tk.decode(list(ids), skip_special_tokens=True)

def train_tokenizer(texts, vocab_size=512):
    """Byte-level BPE as GPT-2's: words keep their leading space (" great"); any string
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
    """A tokenizer.json as Tok; an unreadable one, or one without EOS, is a DataError naming it."""
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
    atomic_write_text(path, tok.tk.to_str(pretty=True))

# -----------------------------------------------------------------------------
# Reading user files. Every bad row is an error naming its file and line; nothing is dropped, or
# read as something else, silently.

class DataError(SystemExit):
    """A bad input file. The message starts with "path:line: ". A SystemExit, so that a user's
    mistake ends the run with that one line and no traceback (as plumbing.check does)."""

def _lines(path):
    """(line number, line) for each line that is not blank; a UTF-8 BOM is not part of line 1."""
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
            if "\r" in line:  # JSON never holds a raw CR, and a text line should not either
                raise DataError(f"{path}:{n}: a carriage return (\\r) inside a line: the file "
                                "has old Mac line endings (CR only)? Convert them to \\n")
            if line.strip():
                yield n, line

def _json_type(v):
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string",
            list: "an array", dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)

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
    """s, unless it holds a lone surrogate escape ("\\ud83d": half an emoji, which the tokenizer
    cannot encode) or EOS or PAD as text (the tokenizer would read them as special)."""
    if re.search("[\ud800-\udfff]", s):
        raise DataError(f"{path}:{n}: {what} holds a lone surrogate escape (half a character)")
    for t in (EOS, PAD):
        if t in s:
            raise DataError(f"{path}:{n}: {what} contains {t}, which the tokenizer would read as "
                            f"its special token")
    return s

# Conversations (TRL's conversational format: lists of {"role", "content"} messages) become text
# by one fixed template, for pairs and SFT text alike: a line per message, "Role: content"
# ("System: Answer briefly.\nUser: Will it rain?\nAssistant: No."). A prompt ends with
# "\nAssistant:", so its response starts with a space, as every response here; except a prompt
# whose last message is the assistant's (render_prompt).
ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}

def render(messages):
    return "\n".join(f"{ROLES[m['role']]}: {m['content']}" for m in messages)

def render_prompt(messages):
    """A conversation as a prompt, by TRL's rule (apply_chat_template in trl/data_utils.py): the
    generation prompt "\nAssistant:" after it, unless its last message is the assistant's, which
    the model then continues (transformers' continue_final_message). A pair's responses then
    follow that message as the next ones: "\nAssistant: ..." (render of prompt + response)."""
    text = render(messages)
    return text if messages[-1]["role"] == "assistant" else text + "\nAssistant:"

# The same template in Jinja, which hf.py exports as the tokenizer's chat_template: transformers'
# apply_chat_template(messages, tokenize=False) then gives render's text, and with
# add_generation_prompt=True a prompt's. The literal text sits in Jinja strings because
# transformers renders with trim_blocks, which drops a newline that follows a tag.
CHAT_TEMPLATE = (
    "{% set names = " + json.dumps(ROLES) + " %}"
    "{% for m in messages %}"
    "{% if m['role'] not in names %}"
    "{{ raise_exception('the template renders the roles system, user and assistant') }}"
    "{% endif %}"
    "{% if not loop.first %}{{ '\\n' }}{% endif %}{{ names[m['role']] }}: {{ m['content'] }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '\\nAssistant:' }}{% endif %}")

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
        problem = _message_problem(m)
        if problem:
            raise DataError(f'{path}:{n}: {key}[{i}] {problem}: the template renders '
                            f'{{"role": "system", "user" or "assistant", "content": a string}}')
        _text(path, n, m["content"], f"{key}[{i}]")
    return v

def _message_problem(m):
    """What is wrong with one message, said whole (not the message cut short), or None."""
    if not isinstance(m, dict):
        return f"is {_json_type(m)}, not an object"
    if set(m) != {"role", "content"}:
        return f'has the keys {", ".join(json.dumps(k) for k in m) or "none"}'
    if m["role"] not in ROLES:
        return f'has the role {json.dumps(m["role"])}'
    if not isinstance(m["content"], str):
        return f'has a content that is {_json_type(m["content"])}'
    return None

def _nonempty(path, rows, what):
    if not rows:
        raise DataError(f"{path}:1: no {what} (the file is empty)")
    return rows

ID_FIELDS = ("prompt_ids", "chosen_ids", "rejected_ids")  # online_dpo.py's pairs.jsonl

def _step(row):
    """A row's "step" (the optimizer step online DPO took it in), kept for --order file."""
    return {"step": row["step"]} if "step" in row else {}

def _id_pair(path, n, row):
    """A row of token ids, as online_dpo.py writes each pair it stepped on: used as they are, not
    encoded again, since a sampled completion need not be the tokenizer's own encoding of its text
    and one that never ended has no EOS. Its texts are there to read; its "step" is kept."""
    for k in ID_FIELDS:
        v = row.get(k)
        if not (isinstance(v, list) and v and all(type(t) is int and t >= 0 for t in v)):
            raise DataError(f'{path}:{n}: field "{k}" must be a non-empty list of token ids '
                            f'(integers >= 0), got {"nothing" if k not in row else _json_type(v)}')
    if row["chosen_ids"] == row["rejected_ids"]:
        raise DataError(f'{path}:{n}: "chosen_ids" and "rejected_ids" are identical')
    texts = {k: row.get(k) if isinstance(row.get(k), str) else "" for k in ("prompt", "chosen",
                                                                           "rejected")}
    return dict(**texts, ids=tuple(row[k] for k in ID_FIELDS), **_step(row))

def read_pairs(path):
    """Preference JSONL in TRL's formats: {"prompt", "chosen", "rejected"}, all strings or all lists
    of messages (rendered by the template); or an implicit prompt: only "chosen" and "rejected",
    full texts or conversations, whose prompt is what both begin with: the messages (as TRL's
    extract_prompt), or the text up to the last whitespace before they differ (TRL cuts at the
    first differing character; we never cut a word). Other fields are ignored, as TRL ignores them
    (scores, ids), except beside implicit-prompt texts: there another key is likelier a misspelled
    "prompt", whose words would silently be read as the texts' common opening. A row with
    "chosen_ids" holds token ids (_id_pair), as online_dpo.py writes them; a "step" is kept."""
    out, repeats = [], []
    for n, line in _lines(path):
        row = _json_row(path, n, line)
        if "chosen_ids" in row:
            out.append(_id_pair(path, n, row))
            continue
        p = _field(path, n, row, "prompt") if "prompt" in row else None
        c, r = _field(path, n, row, "chosen"), _field(path, n, row, "rejected")
        extra = sorted(set(row) - {"chosen", "rejected"})
        if p is None and extra and isinstance(c, str):
            raise DataError(f'{path}:{n}: no "prompt" field but other fields ({", ".join(extra)}): '
                            f'a misspelled "prompt"? A row of texts without one holds only the '
                            f'responses')
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
            x = render_prompt(p)
            p, c, r = x, render(p + c)[len(x):], render(p + r)[len(x):]
        for key, v in (("chosen", c), ("rejected", r)):
            if not v.strip():  # an empty assistant message renders as " "
                what = "empty" if not v else "only whitespace (an empty assistant message?)"
                raise DataError(f'{path}:{n}: field "{key}" is {what}: nothing to prefer')
        if p is not None and p.strip() and all(v.lstrip().startswith(p.strip()) for v in (c, r)):
            repeats.append(n)  # once is the text's own choice; in every row, full texts
        if isinstance(c, str) and c.strip() == r.strip():
            raise DataError(f'{path}:{n}: "chosen" and "rejected" differ only in white space')
        if p is None:
            k = len(os.path.commonprefix([c, r]))
            cut = max((i for i in range(k) if c[i].isspace()), default=0)
            if cut == 0:
                raise DataError(f'{path}:{n}: no "prompt" field, and "chosen" and "rejected" share '
                                f'no prompt (no whitespace inside their common prefix)')
            p, c, r = c[:cut], c[cut:], r[cut:]
        out.append(dict(prompt=p, chosen=c, rejected=r, **_step(row)))
    if out and len(repeats) == len(out):  # a sentence may repeat its prompt; every row, no
        raise DataError(f'{path}:{repeats[0]}: in every row "chosen" and "rejected" both begin '
                        f'with the prompt: full texts beside a "prompt" field? Give the responses '
                        f'without it, or drop "prompt" (the texts\' common opening is then the '
                        f'prompt)')
    return _nonempty(path, out, "rows")

def _plain_lines(path, what):
    """The lines of a plain-text file, each one text; a line that is a JSON object means the file
    is JSONL under another name, whose rows would be used literally, braces and all."""
    out = []
    for n, s in _lines(path):
        if s.lstrip().startswith("{"):
            try:
                is_row = isinstance(json.loads(s), dict)
            except json.JSONDecodeError:
                is_row = False
            if is_row:
                raise DataError(f"{path}:{n}: the line is a JSON object, but a file whose name "
                                f"does not end in .jsonl is read as plain text, a {what} per line "
                                f"(braces and all): name it .jsonl")
        out.append(_text(path, n, s, "the line"))
    return out

def row_lines(path):
    """The line number of each row read_pairs (or read_prompts) returns: one per non-blank line."""
    return [n for n, _ in _lines(path)]

def read_prompts(path):
    """JSONL rows {"prompt": a string or messages} when the name ends in .jsonl (messages rendered
    by render_prompt), else plain text, a prompt per line."""
    if path.endswith(".jsonl"):
        ps = [_field(path, n, _json_row(path, n, line), "prompt") for n, line in _lines(path)]
        return _nonempty(path, [p if isinstance(p, str) else render_prompt(p) for p in ps],
                         "prompts")
    return _nonempty(path, _plain_lines(path, "prompt"), "prompts")

def read_texts(path):
    """SFT text: JSONL rows {"text": str} or {"messages": [...]} (rendered by the template) when
    the name ends in .jsonl (a text may then hold newlines), else plain text, a text per line."""
    if not path.endswith(".jsonl"):
        return _nonempty(path, _plain_lines(path, "text"), "texts")
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

def encode_prompts(tok, texts, n):
    """Each prompt text as ids cut to at most n tokens (truncate_prompt); returns (ids, how many
    were cut), the count for the stage to say."""
    ids = [encode_prompt(tok, t) for t in texts]
    return [truncate_prompt(x, n) for x in ids], sum(len(x) > n for x in ids)

def tokenize_pairs(tok, rows, max_len, max_prompt_len, path="the pairs"):
    """Rows {"prompt","chosen","rejected"} -> examples dict(index, prompt, chosen, rejected) of
    token ids, index = the row's position in rows (the reference log-prob cache key), and stats.
    A row of ids (read_pairs: online_dpo.py's) keeps its ids; one outside the tokenizer's is an
    error naming the row of path (read_pairs' file).
    Our truncation, when len(prompt) + len(longer response) > max_len (all counts with BOS/EOS):
      1. the prompt keeps its BOS and its last tokens, max(max_len - len(longer response),
         max_prompt_len) in all: cut only as much as needed, never below max_prompt_len;
      2. then each response keeps its first max_len - len(prompt) tokens (a cut response loses its
         EOS: it did not end). At least max_len - max_prompt_len >= 1 tokens of each are left.
    (TRL 1.16's DPOTrainer keeps the first max_length tokens of prompt + response instead.) A row
    whose two responses become identical teaches nothing (unusable): left out and counted.
    stats = {"rows", "truncated_prompt", "truncated_response", "unusable"}."""
    assert 2 <= max_prompt_len < max_len, \
        f"need 2 <= max_prompt_len ({max_prompt_len}) < max_len ({max_len})"
    stats = dict(rows=len(rows), truncated_prompt=0, truncated_response=0, unusable=0)
    examples, cut = [], set()
    for i, row in enumerate(rows):
        if "ids" in row:
            x, yc, yr = (list(v) for v in row["ids"])
            _check_ids(tok, x, yc, yr, path, i)
        else:
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
                cut.add(i)
        if yc == yr:
            stats["unusable"] += 1
            continue
        examples.append(dict(index=i, prompt=x, chosen=yc, rejected=yr))
    # stats["chosen_lost_eos"], stats["rejected_lost_eos"]: usable pairs whose chosen (rejected)
    # response was cut, so lost its EOS; counted per side, as an uneven cut is learned (a sampled
    # completion that never ended had none to lose)
    for k in ("chosen", "rejected"):
        stats[f"{k}_lost_eos"] = sum(e[k][-1] != tok.eos for e in examples if e["index"] in cut)
    return examples, stats

def _check_ids(tok, x, yc, yr, path, i):
    """A row of ids (rows[i] of path) as online_dpo.py writes them, or a DataError naming its line
    and field: ids of this tokenizer; a prompt that starts with BOS, as every sequence does
    (encode_prompt), and holds no PAD (generate's left padding, not a token); responses that end
    at their EOS, if they have one (generate stops a row there: what follows, PAD or not, is
    padding or another text). A PAD id before that end is kept: the policy samples from the whole
    vocabulary, PAD's id included, and online DPO's step trained on it as a token."""
    line = lambda: row_lines(path)[i] if os.path.exists(path) else i + 1  # noqa: E731
    if max(x + yc + yr) >= tok.vocab_size:
        raise DataError(f"{path}:{line()}: token id {max(x + yc + yr)} is not one of the "
                        f"tokenizer's {tok.vocab_size}: written with another tokenizer?")
    if x[0] != tok.eos:
        raise DataError(f'{path}:{line()}: field "prompt_ids" starts with {x[0]}, not BOS (the '
                        f'tokenizer\'s {EOS}, id {tok.eos}), as every sequence here does: '
                        f'prepend it')
    if tok.pad in x:
        raise DataError(f'{path}:{line()}: field "prompt_ids" holds the PAD id {tok.pad} at '
                        f'position {x.index(tok.pad)}: padding, not a token of the prompt')
    for k, y in (("chosen_ids", yc), ("rejected_ids", yr)):
        end = y.index(tok.eos) + 1 if tok.eos in y else len(y)
        if end < len(y):
            what = "PAD ids (padding)" if set(y[end:]) == {tok.pad} else "more tokens"
            raise DataError(f'{path}:{line()}: field "{k}" goes on after its EOS (position '
                            f'{end - 1}) with {len(y) - end} {what}: a response ends at its '
                            f'EOS; cut it there')

HEAVY_CUT = 0.05  # truncation_warning speaks when more than this fraction of the rows lose tokens

# what a user can do when truncation_warning speaks of pairs cut to --max_len (precompute, dpo)
TRUNCATION_FIX = ("Raise --max_len (up to π_ref's block_size), or retrain π_ref (sft.py) with a "
                  "larger --block_size and a tokenizer made for your text (--tokenizer).")

def truncation_warning(stats, path, max_len, fix=TRUNCATION_FIX):
    """A loud warning from tokenize_pairs' stats, "" when there is nothing to say. Heavy: more than
    HEAVY_CUT of the rows have their prompt, or a response, cut. Uneven: the c chosen and r rejected
    responses that lost their EOS differ by more than 2·sqrt(c + r), two standard deviations of a
    fair split: where chosen responses are the longer ones, DPO and r_φ then learn to prefer
    responses that do not stop. `fix` says what the stage's user can do about it."""
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
    """SFT examples dict(index, prompt=[eos], response=encode(text) + [eos]), the response cut to
    max_len - 1 tokens. stats = {"rows", "truncated"}."""
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
    targets[t] = input_ids[t+1] where that token is a response token, else IGNORE. Right padding
    keeps every real token at its unpadded position (no mask needed)."""
    N, T = len(pairs_of_prompt_response), max(len(x) + len(y) for x, y in pairs_of_prompt_response)
    ids = torch.full((N, T), pad_id, dtype=torch.long)
    targets = torch.full((N, T), IGNORE, dtype=torch.long)
    for i, (x, y) in enumerate(pairs_of_prompt_response):
        assert len(x) >= 1, "a prompt holds at least the BOS"
        ids[i, :len(x) + len(y)] = torch.tensor(x + y)
        # position t predicts token t+1
        targets[i, len(x) - 1:len(x) + len(y) - 1] = torch.tensor(y)
    return ids, targets

def collate_pairs(examples, pad_id, pack_len=0):
    """B examples -> dict(input_ids (2B,T), targets (2B,T), seq None, index (B,) long): rows
    [chosen_0..chosen_{B-1}; rejected_0..rejected_{B-1}], so one forward scores both halves.
    pack_len > 0: the same sequences packed into rows of at most pack_len tokens (pack_pairs)."""
    if pack_len:
        return pack_pairs(examples, pad_id, pack_len)
    ids, targets = collate([(e["prompt"], e["chosen"]) for e in examples] +
                           [(e["prompt"], e["rejected"]) for e in examples], pad_id)
    return dict(input_ids=ids, targets=targets, seq=None,
                index=torch.tensor([e["index"] for e in examples]))

def batch_to(b, device):
    """A pair batch's (input_ids, targets, seq) on device; seq stays None in a padded batch."""
    return (b["input_ids"].to(device), b["targets"].to(device),
            None if b["seq"] is None else b["seq"].to(device))

def pack_pairs(examples, pad_id, max_len):
    """collate_pairs' 2B sequences without its padding: each whole in one row of at most max_len
    tokens (every sequence fits: tokenize_pairs cut it to max_len), placed first-fit in order of
    decreasing length (FFD bin packing, Johnson 1973), so nearly every position is a real token.
    Returns dict(input_ids (R,L), targets (R,L) as collate's within each sequence (the last token
    of a sequence predicts nothing: IGNORE), seq (R,L) long, the sequence each position holds:
    k < B is chosen_k, k >= B rejected_{k-B}, collate_pairs' row k (-1 on the padding at a row's
    end), index (B,) long). GPT.forward(mask=seq) attends within each sequence and restarts its
    positions at 0 (OpenRLHF's packing_samples, TRL's padding_free: the same idea);
    model.pair_logps(..., seq) sums each sequence."""
    seqs = [e["prompt"] + e[k] for k in ("chosen", "rejected") for e in examples]
    n_prompt = [len(e["prompt"]) for e in examples] * 2
    rows, room = [], []  # the sequence ids in each row, the tokens left in it
    for k in sorted(range(len(seqs)), key=lambda k: -len(seqs[k])):  # stable: ties keep k's order
        assert len(seqs[k]) <= max_len, f"a sequence of {len(seqs[k])} tokens > max_len {max_len}"
        r = next((r for r, left in enumerate(room) if left >= len(seqs[k])), len(rows))
        if r == len(rows):
            rows.append([]), room.append(max_len)
        rows[r].append(k)
        room[r] -= len(seqs[k])
    shape = (len(rows), max_len - min(room))
    ids, targets = torch.full(shape, pad_id), torch.full(shape, IGNORE)
    seq = torch.full(shape, -1)
    for r, ks in enumerate(rows):
        t = 0
        for k in ks:
            n, P = len(seqs[k]), n_prompt[k]
            ids[r, t:t + n], seq[r, t:t + n] = torch.tensor(seqs[k]), k
            targets[r, t + P - 1:t + n - 1] = torch.tensor(seqs[k][P:])  # t predicts t+1
            t += n
    return dict(input_ids=ids, targets=targets, seq=seq,
                index=torch.tensor([e["index"] for e in examples]))

# -----------------------------------------------------------------------------
# Rank sharding: the global batch at a step depends on (n, batch_size, step, seed, lengths) only:
# any world size trains on the same data in the same order, and a resumed run continues.

def longest_row(example):
    """Tokens of the longest row an example puts in a batch: prompt + longer response, or text."""
    return len(example["prompt"]) + max(len(example[k]) for k in ("chosen", "rejected", "response")
                                        if k in example)

def global_batch(n, batch_size, step, seed, lengths=None):
    """Indices of the global batch at step: epoch-wise permutation, incomplete tail dropped.
    With lengths (one per example, e.g. longest_row), the same batch sorted by length, longest
    first (ties keep their random order): every micro-batch cut from it, and every rank's share of
    it (both contiguous), then holds rows of about one length and is padded only to its own longest.
    The batch is still a uniform sample of the data: the step's loss and gradient are the unsorted
    batch's (up to the order of fp32 sums); only the padding drops. Not Hugging Face's
    group_by_length, which sorts windows of many batches so a batch holds one length: that changes
    training (r_φ's held-out accuracy fell from 0.820 to 0.678 with windows of 8 batches)."""
    per_epoch = n // batch_size
    assert per_epoch >= 1, f"batch size {batch_size} is larger than the data ({n} examples)"
    epoch, i = divmod(step, per_epoch)
    batch = np.random.default_rng(seed + epoch).permutation(n)[i * batch_size:(i + 1) * batch_size]
    if lengths is not None:
        assert len(lengths) == n, f"{len(lengths)} lengths for {n} examples"
        batch = batch[np.argsort(-np.asarray(lengths)[batch], kind="stable")]
    return batch.tolist()

def file_batches(rows, examples, batch_size, path):
    """The global batches of one pass over the pairs in the file's order (dpo.py --order file),
    each a list of positions in examples (the usable rows, by their "index"). Rows with a "step"
    (online_dpo.py's pairs.jsonl) make a batch per step, as online DPO took them; rows without
    one, a batch per batch_size rows (a short tail dropped, as global_batch drops it). Rows with
    a "step" must be rows of token ids: a replay is of the tokens the run stepped on."""
    has = [("step" in r) for r in rows]
    if any(has) and not all(has):
        n = row_lines(path)[has.index(not has[0])]
        raise DataError(f'{path}:{n}: some rows have a "step" and some do not: --order file '
                        f'takes a step per "step" value, or per --batch_size rows; not both')
    if not any(has):
        keys = [i // batch_size for i in range(len(rows) // batch_size * batch_size)]
    else:
        text = next((j for j, r in enumerate(rows) if "ids" not in r), None)
        if text is not None:  # a replay of texts is not the run: their encoding is not its tokens
            raise DataError(f'{path}:{row_lines(path)[text]}: a row with a "step" holds texts, not '
                            f'the token ids online DPO stepped on: encoded again, a completion '
                            f'that never ended gains an EOS, so these steps are not its steps. '
                            f'Pass its pairs.jsonl with "prompt_ids", "chosen_ids" and '
                            f'"rejected_ids", or drop "step" to take a step per --batch_size rows')
        keys, lines = [r["step"] for r in rows], row_lines(path)
        for j, k in enumerate(keys):
            if type(k) is not int or (j and k < keys[j - 1]):
                raise DataError(f'{path}:{lines[j]}: "step" {json.dumps(k)} must be an integer, '
                                f'at or after the row before\'s: the rows are in the order they '
                                f'were trained on')
    at = {e["index"]: j for j, e in enumerate(examples)}
    batches = {}
    for i, k in enumerate(keys):
        if i in at:
            batches.setdefault(k, []).append(at[i])
    return list(batches.values())

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
    held out), sft_{train,val}.jsonl ({"text": prompt + chosen}), prompts_test.jsonl (the held-out
    prompts, to report on; choosing settings on them too needs a --val_prompts set of your own),
    tokenizer.json (byte-level BPE on the train rows). Returns block_size, or (0) the
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
        atomic_write_text(os.path.join(out_dir, f"pairs_{name}.jsonl"), jsonl(rs))
        atomic_write_text(os.path.join(out_dir, f"sft_{name}.jsonl"),
                          jsonl({"text": r["prompt"] + r["chosen"]} for r in rs))
    atomic_write_text(os.path.join(out_dir, "prompts_test.jsonl"),
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
            f"{o('pairs_train.jsonl')} --val_pairs {o('pairs_val.jsonl')} --test_prompts "
            f"{o('prompts_test.jsonl')} --max_len {block} --max_prompt_len {block // 2}"
            f"{batch(64)} --out_dir {o('dpo')}"]

if __name__ == "__main__":
    import argparse
    import sys
    if sys.argv[1:2] != ["own"]:
        sys.exit("usage: python data.py own PAIRS.jsonl [--out DIR]  (the built-in task: task.py)")
    ap = argparse.ArgumentParser(prog="python data.py own", description=own_data.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pairs", help="your preference JSONL")
    ap.add_argument("--out", default="out/own", help="the folder to write")
    ap.add_argument("--vocab_size", type=int, default=1024, help="the tokenizer's")
    ap.add_argument("--block_size", type=int, default=0, help="0: fit the longest pair")
    a = ap.parse_args(sys.argv[2:])
    own_data(a.pairs, a.out, a.vocab_size, a.block_size)
