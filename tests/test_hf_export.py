"""GPT-2 in and out (hf.py): an import gives GPT-2's logits, written out here by hand, for every
config option it honours, and one error line for every one it refuses and for another architecture;
the exported folder is what transformers' from_pretrained reads, and its chat template renders
data.py's text byte for byte; sft.py --init_from takes the shape from the folder's config.json.

    pytest tests/test_hf_export.py
"""
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers

import data
import sft
from hf import export_gpt2, import_gpt2
from model import load_model, save_model
from tests.helpers import EXAMPLE, ROOT, TINY_MODEL, msgs, tiny_gpt


# ==================================================================================================
# GPT-2 import and export (hf.py, sft.py --init_from)
# ==================================================================================================

def fake_hf_gpt2(V=11, C=16, L=2, n_pos=24, prefix="transformer."):
    """A GPT-2 state dict with Hugging Face's names and Conv1D (in, out) weight shapes."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g) * 0.3
    sd = {"wte.weight": r(V, C), "wpe.weight": r(n_pos, C), "ln_f.weight": 1 + r(C),
          "ln_f.bias": r(C)}
    for i in range(L):
        h = f"h.{i}."
        sd |= {h + "ln_1.weight": 1 + r(C), h + "ln_1.bias": r(C), h + "ln_2.weight": 1 + r(C),
               h + "ln_2.bias": r(C),
               h + "attn.c_attn.weight": r(C, 3 * C), h + "attn.c_attn.bias": r(3 * C),
               h + "attn.c_proj.weight": r(C, C), h + "attn.c_proj.bias": r(C),
               h + "mlp.c_fc.weight": r(C, 4 * C), h + "mlp.c_fc.bias": r(4 * C),
               h + "mlp.c_proj.weight": r(4 * C, C), h + "mlp.c_proj.bias": r(C),
               h + "attn.bias": torch.ones(1, 1, n_pos, n_pos).tril(),
               h + "attn.masked_bias": torch.tensor(-1e4)}
    sd = {prefix + k: v for k, v in sd.items()}
    sd["lm_head.weight"] = sd[prefix + "wte.weight"].clone()
    return sd


def reference_gpt2(sd, idx, n_head):
    """GPT-2's forward written out with plain ops over the Hugging Face dict (x @ W for Conv1D)."""
    sd = {k.removeprefix("transformer."): v.double() for k, v in sd.items()}
    T = idx.shape[1]
    ln = lambda x, p: F.layer_norm(x, x.shape[-1:], sd[p + ".weight"], sd[p + ".bias"], eps=1e-5)
    gelu_new = lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi)
                                                   * (x + 0.044715 * x ** 3)))
    x = sd["wte.weight"][idx] + sd["wpe.weight"][:T]
    L = sum(k.endswith("ln_1.weight") for k in sd)
    for i in range(L):
        p = f"h.{i}."
        q, k, v = (ln(x, p + "ln_1") @ sd[p + "attn.c_attn.weight"]
                   + sd[p + "attn.c_attn.bias"]).chunk(3, -1)
        q, k, v = (t.unflatten(-1, (n_head, -1)).transpose(1, 2) for t in (q, k, v))
        att = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        att = att.masked_fill(torch.ones(T, T).tril() == 0, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).flatten(2)
        x = x + y @ sd[p + "attn.c_proj.weight"] + sd[p + "attn.c_proj.bias"]
        hdn = gelu_new(ln(x, p + "ln_2") @ sd[p + "mlp.c_fc.weight"] + sd[p + "mlp.c_fc.bias"])
        x = x + hdn @ sd[p + "mlp.c_proj.weight"] + sd[p + "mlp.c_proj.bias"]
    return ln(x, "ln_f") @ sd["wte.weight"].T


def test_gpt2_import_export(tmp_path):
    for prefix in ("transformer.", ""):
        d = tmp_path / f"hf{prefix}"
        d.mkdir()
        sd = fake_hf_gpt2(prefix=prefix)
        save_file(sd, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps({"n_head": 4, "activation_function": "gelu_new"}))
        m = import_gpt2(str(d / "model.safetensors")).double()
        assert (m.config.n_head, m.config.n_layer, m.config.block_size,
                m.config.vocab_size) == (4, 2, 24, 11)
        idx = torch.randint(0, 11, (2, 9))
        assert torch.allclose(m(idx), reference_gpt2(sd, idx, n_head=4), atol=1e-10, rtol=0)
        export_gpt2(m.float(), word_tokenizer(tmp_path / "tok.json", "a b c"),
                    str(tmp_path / "out"))
        out = load_file(str(tmp_path / "out" / "model.safetensors"))
        want = {"transformer." + k.removeprefix("transformer."): v for k, v in sd.items()
                if not k.endswith((".attn.bias", ".attn.masked_bias")) and k != "lm_head.weight"}
        assert out.keys() == want.keys() and all(torch.equal(out[k], want[k]) for k in want)
        cfg = json.loads((tmp_path / "out" / "config.json").read_text())
        assert (cfg["model_type"] == "gpt2" and cfg["activation_function"] == "gelu_new"
                and cfg["n_head"] == 4)
        assert (cfg["n_positions"], cfg["tie_word_embeddings"]) == (24, True)
    # a shorter context keeps wpe's first rows
    m = import_gpt2(str(d / "model.safetensors"), block_size=10)
    assert torch.equal(m.transformer.wpe.weight, sd["wpe.weight"][:10])
    # room for the PAD our tokenizer adds
    m = import_gpt2(str(d / "model.safetensors"), vocab_size=12)
    assert m.config.vocab_size == 12 and torch.equal(m.transformer.wte.weight[:11],
                                                     sd["wte.weight"])
    assert (m.lm_head.weight is m.transformer.wte.weight
            and m(torch.tensor([[11, 3]])).shape == (1, 2, 12))


def word_tokenizer(path, words):
    """A tokenizer.json of whitespace-split words: EOS 0, PAD 1, then the words. Returns its
    path."""
    vocab = {data.EOS: 0, data.PAD: 1, **{w: i + 2 for i, w in enumerate(words.split())}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token=data.EOS))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.add_special_tokens([data.EOS, data.PAD])
    tk.save(str(path))
    return str(path)


HONOURED = [{}, {"n_head": 4, "n_embd": 16, "n_layer": 2, "vocab_size": 11, "n_positions": 24},
            {"activation_function": "gelu_pytorch_tanh"}, {"reorder_and_upcast_attn": True},
            {"n_inner": None}, {"n_inner": 64}, {"layer_norm_epsilon": 1e-5},
            {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False},
            {"tie_word_embeddings": True, "add_cross_attention": False, "model_type": "gpt2"}]


REFUSED = [("layer_norm_epsilon", 1e-3), ("scale_attn_weights", False),
           ("scale_attn_by_inverse_layer_idx", True), ("n_positions", 32), ("n_inner", 32),
           ("tie_word_embeddings", False), ("activation_function", "gelu"),
           ("activation_function", "relu"), ("add_cross_attention", True),
           ("model_type", "gpt_neo"),
           ("n_embd", 32), ("n_layer", 3), ("vocab_size", 12)]


def test_gpt2_import_honours_or_refuses_every_config_option(tmp_path):
    sd = fake_hf_gpt2()
    save_file(sd, str(tmp_path / "model.safetensors"))
    path, idx = str(tmp_path / "model.safetensors"), torch.randint(0, 11, (2, 9))
    # honoured: the same logits as GPT-2's forward written out by hand (float64: only rounding)
    for opts in HONOURED:
        (tmp_path / "config.json").write_text(json.dumps({"n_head": 4, **opts}))
        m = import_gpt2(path).double()
        assert torch.allclose(m(idx), reference_gpt2(sd, idx, n_head=4), atol=1e-10, rtol=0), opts
    # refused: an error line naming the option and its value, never other logits
    for k, v in REFUSED:
        (tmp_path / "config.json").write_text(json.dumps({"n_head": 4, k: v}))
        with pytest.raises(SystemExit,
                           match=f"^error: {tmp_path}/config.json: {k}={json.dumps(v)} "):
            import_gpt2(path)
    (tmp_path / "config.json").write_text(json.dumps({"n_head": 4}))
    with pytest.raises(SystemExit, match="block_size 25 > the 24 positions"):
        import_gpt2(path, block_size=25)
    # the argument contradicts the file
    with pytest.raises(SystemExit, match="n_head=4 is refused"):
        import_gpt2(path, n_head=2)
    save_file({**sd, "lm_head.weight": sd["lm_head.weight"] + 1},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(SystemExit, match="lm_head differs from wte"):
        import_gpt2(path)
    # no config.json: n_head is not guessed from the shapes; given, it imports exactly
    (tmp_path / "config.json").unlink()
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(SystemExit, match="no config.json beside it, so n_head is unknown"):
        import_gpt2(path)
    m = import_gpt2(path, n_head=4).double()
    assert torch.allclose(m(idx), reference_gpt2(sd, idx, n_head=4), atol=1e-10, rtol=0)


def test_gpt2_import_refuses_another_architecture(tmp_path):
    """A Llama checkpoint (its config, its tensor names) is one error line naming what it is and
    what imports, with or without its config.json, never a KeyError."""
    g = torch.Generator().manual_seed(0)
    save_file({k: torch.randn(8, 4, generator=g) for k in
               ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                "model.norm.weight", "lm_head.weight")}, str(tmp_path / "model.safetensors"))
    path = str(tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4}))
    with pytest.raises(SystemExit, match=re.escape(
            f'error: {tmp_path}/config.json: model_type="llama" (LlamaForCausalLM) is refused: '
            f'only GPT-2 imports (model_type "gpt2", GPT2LMHeadModel)')):
        import_gpt2(path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))  # no architectures
    with pytest.raises(SystemExit, match='model_type="llama" is refused'):
        import_gpt2(path)
    # GPT-2's model_type with another head: its tensors would not load
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "architectures": ["GPT2ForSequenceClassification"]}))
    with pytest.raises(SystemExit,
                       match=r'model_type="gpt2" \(GPT2ForSequenceClassification\) is refused'):
        import_gpt2(path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(SystemExit, match=re.escape(f"error: {path}: no wte.weight among its "
                                                   f"tensors (")) as e:
        import_gpt2(path, n_head=4)
    assert "model.embed_tokens.weight" in str(e.value) and "not a GPT-2 checkpoint" in str(e.value)


def test_export_folder_for_transformers(tmp_path):
    """The exported folder holds what transformers' from_pretrained reads, by its documented schema;
    a separate venv with transformers loaded it by hand (see the README)."""
    texts = ["the movie is great .", "i hated the plot .", "User: hi\nAssistant: hello"] * 20
    tok = data.train_tokenizer(texts, vocab_size=300)
    src = tmp_path / "sft"
    src.mkdir()
    data.save_tokenizer(tok, str(src / "tokenizer.json"))
    m = tiny_gpt(vocab_size=tok.vocab_size).float()
    save_model(m, str(src / "model.safetensors"), {"stage": "sft"})
    p = subprocess.run([sys.executable, os.path.join(ROOT, "hf.py"), "export",
                        str(src / "model.safetensors"), str(tmp_path / "hf")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    out = tmp_path / "hf"
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors",
                                       "special_tokens_map.json", "tokenizer.json",
                                       "tokenizer_config.json"]
    read = lambda name: json.loads((out / name).read_text())  # noqa: E731
    ids = dict(bos_token_id=tok.eos, eos_token_id=tok.eos, pad_token_id=tok.pad)
    cfg = read("config.json")
    assert cfg.items() >= {**ids, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                           "vocab_size": tok.vocab_size, "n_positions": 32, "n_embd": 16,
                           "n_layer": 2, "n_head": 2, "activation_function": "gelu_new",
                           "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True}.items()
    assert read("generation_config.json") == ids
    special = dict(bos_token=data.EOS, eos_token=data.EOS, pad_token=data.PAD)
    assert read("special_tokens_map.json") == special
    assert read("tokenizer_config.json") == {**special,
                                             "tokenizer_class": "PreTrainedTokenizerFast",
                                             "model_max_length": 32,
                                             "model_input_names": ["input_ids", "attention_mask"],
                                             "clean_up_tokenization_spaces": False,
                                             "chat_template": data.CHAT_TEMPLATE,
                                             "padding_side": "left"}  # for batched generate
    # the tokenizer puts the BOS first, as every sequence here starts; without it, our ids
    hf_tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert hf_tok.encode(" the movie").ids == data.encode_prompt(tok, " the movie")
    assert hf_tok.encode(" the movie", add_special_tokens=False).ids == tok.encode(" the movie")
    # the weights: importing the folder back gives the model's logits exactly
    idx = torch.randint(0, tok.vocab_size, (2, 9))
    assert torch.equal(import_gpt2(str(out / "model.safetensors"))(idx), m(idx))
    # a tokenizer without PAD (as GPT-2's) gets it as the next id, as data.Tok does
    tk = Tokenizer(models.WordLevel({data.EOS: 0, "the": 1, "movie": 2}, unk_token=data.EOS))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.add_special_tokens([data.EOS])
    tk.save(str(tmp_path / "nopad.json"))
    export_gpt2(tiny_gpt(vocab_size=4).float(), str(tmp_path / "nopad.json"), str(tmp_path / "hf2"))
    assert json.loads((tmp_path / "hf2" / "config.json").read_text())["pad_token_id"] == 3
    assert Tokenizer.from_file(str(tmp_path / "hf2" / "tokenizer.json")).token_to_id(data.PAD) == 3
    with pytest.raises(SystemExit, match="has 4 tokens, the model only 3"):
        export_gpt2(tiny_gpt(vocab_size=3).float(), str(tmp_path / "nopad.json"),
                    str(tmp_path / "x"))


def chat_template_renderer(template):
    """apply_chat_template(messages, tokenize=False, ...) as transformers renders a chat_template:
    a sandboxed jinja2 environment with trim_blocks and lstrip_blocks, raise_exception, and the
    special tokens by name; continue_final_message cuts the text after the last message."""
    jinja2 = pytest.importorskip("jinja2")
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)
    env.globals["raise_exception"] = raise_exception
    compiled = env.from_string(template)
    def apply(messages, add_generation_prompt=False, continue_final_message=False):
        text = compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=data.EOS, eos_token=data.EOS, pad_token=data.PAD)
        if continue_final_message:
            last = messages[-1]["content"]
            text = text[:text.rindex(last) + len(last)]
        return text
    return apply


def trl_pair(apply, row):
    """TRL's maybe_extract_prompt then apply_chat_template (trl/data_utils.py) on a conversational
    preference row: an implicit prompt is the messages both responses begin with; the prompt gets
    the generation prompt after a user turn, continues a final assistant turn; each response is
    the rendered prompt + response past the common prefix of the rendered prompt and both."""
    if "prompt" not in row:
        k = next(i for i, (a, b) in enumerate(zip(row["chosen"], row["rejected"])) if a != b)
        row = dict(prompt=row["chosen"][:k], chosen=row["chosen"][k:],
                   rejected=row["rejected"][k:])
    last = row["prompt"][-1]["role"]
    assert last in ("user", "assistant"), "TRL refuses a prompt ending with a system turn"
    prompt = apply(row["prompt"], add_generation_prompt=last == "user",
                   continue_final_message=last == "assistant")
    full = {k: apply(row["prompt"] + row[k]) for k in ("chosen", "rejected")}
    prompt = os.path.commonprefix([prompt, *full.values()])
    return dict(prompt=prompt, **{k: v[len(prompt):] for k, v in full.items()})


def test_exported_chat_template_renders_the_one_template(tmp_path):
    """transformers' apply_chat_template with the exported chat_template gives data.py's text byte
    for byte: SFT text, prompts, and TRL's rendering of conversational pairs."""
    export_gpt2(tiny_gpt(vocab_size=4).float(), word_tokenizer(tmp_path / "tok.json", "a b"),
                str(tmp_path / "hf"))
    config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    apply = chat_template_renderer(config["chat_template"])
    odd = 'quotes \' " {{ not jinja }} {% raw %} <b>&amp;</b>\n two lines, été '
    convs = [msgs(("user", "Rain today?")),
             msgs(("system", "Be brief."), ("user", "Rain today?")),
             msgs(("user", "a"), ("assistant", "b"), ("user", odd)),
             msgs(("system", odd), ("user", "c"), ("assistant", "d"), ("user", "e")),
             msgs(("user", "Name a colour."), ("assistant", "Here is one:"))]  # to continue
    answers = [msgs(("assistant", "No.")), msgs(("assistant", odd)),
               msgs(("assistant", "x"), ("user", "y?"), ("assistant", "z"))]
    rows = [dict(prompt=c, chosen=answers[i % 3], rejected=answers[(i + 1) % 3])
            for i, c in enumerate(convs)]
    # implicit prompts, beside another field (TRL's extract_prompt, which ignores it)
    rows += [dict(chosen=c + answers[0], rejected=c + answers[2], score=1) for c in convs]
    write = lambda name, objs: (tmp_path / name).write_text(  # noqa: E731
        "".join(json.dumps(o) + "\n" for o in objs))
    write("t.jsonl", [{"messages": c + a} for c in convs for a in answers])
    assert data.read_texts(str(tmp_path / "t.jsonl")) == [
        apply(c + a) for c in convs for a in answers]
    write("p.jsonl", [{"prompt": c} for c in convs])
    assert data.read_prompts(str(tmp_path / "p.jsonl")) == [
        apply(c, add_generation_prompt=c[-1]["role"] == "user",
              continue_final_message=c[-1]["role"] == "assistant") for c in convs]
    write("pairs.jsonl", rows)
    assert data.read_pairs(str(tmp_path / "pairs.jsonl")) == [trl_pair(apply, r) for r in rows]
    # a role the template cannot render is an error, not a line without its role
    with pytest.raises(Exception, match="system, user and assistant"):
        apply(msgs(("tool", "42")))


def test_sft_init_from_takes_the_shape_from_config_json(tmp_path, capsys):
    # a 4-head GPT-2 folder: sft.py's --n_head (2 here) must not override, nor guess, its heads
    data.own_data(EXAMPLE, str(tmp_path / "own"), vocab_size=300, log=lambda *a: None)
    o = lambda name: str(tmp_path / "own" / name)  # noqa: E731
    tok, src = data.load_tokenizer(o("tokenizer.json")), tmp_path / "hf"
    export_gpt2(tiny_gpt(vocab_size=tok.vocab_size, block_size=96, n_head=4, n_embd=32).float(),
                o("tokenizer.json"), str(src))
    args = dict(out_dir=str(tmp_path / "sft"), train_text=o("sft_train.jsonl"),
                val_text=o("sft_val.jsonl"), tokenizer=o("tokenizer.json"),
                init_from=str(src / "model.safetensors"), **{**TINY_MODEL, "block_size": 96},
                steps=1, batch_size=16, micro_batch_size=16)
    assert args["n_head"] == 2
    sft.main(sft.Config(**args))
    assert "n_layer 2, n_head 4, n_embd 32 (its config.json" in capsys.readouterr().out
    assert load_model(str(tmp_path / "sft" / "model.safetensors"))[0].config.n_head == 4
    os.remove(src / "config.json")
    with pytest.raises(SystemExit, match="no config.json beside it, so its number of heads is "
                                         "unknown: copy the model's config.json next to it$"):
        sft.main(sft.Config(**{**args, "out_dir": str(tmp_path / "sft2")}))
