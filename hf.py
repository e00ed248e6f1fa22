"""Hugging Face GPT-2, both ways: import its weights into our GPT, export ours as a folder that
transformers loads as it is (AutoModelForCausalLM.from_pretrained, AutoTokenizer.from_pretrained).

    python hf.py export out/dpo/model.safetensors hf/dpo   # any stage's model and its tokenizer

model.py's module names are Hugging Face GPT-2's, so both directions are a rename and a Conv1D
transpose; the forward math is GPT-2's, so imported weights give Hugging Face's logits.
"""
import json
import os

import torch
from safetensors.torch import load_file, save
from tokenizers import Tokenizer, processors

from data import CHAT_TEMPLATE, EOS, PAD
from model import GPT, GPTConfig, load_model
from plumbing import check

# Hugging Face's GPT-2 stores these as Conv1D, whose weight is (in, out): nn.Linear's transposed
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def import_gpt2(path, block_size=None, vocab_size=None, n_head=None):
    """GPT from a Hugging Face GPT-2 model.safetensors (keys with or without "transformer.") and the
    config.json beside it; without one, n_head must be given (the shapes give the rest).
    block_size < n_positions keeps the first rows of the position table. vocab_size > the file's
    appends embedding rows (GPT-2 has no PAD; our tokenizer adds it as 50257). Every GPT2Config
    option that changes the function is honoured, or refused with its name and value; another
    architecture (model_type, architectures) is refused by name."""
    sd = {k.removeprefix("transformer."): v for k, v in load_file(path).items()}
    # attn.bias / attn.masked_bias are the causal-mask buffers of older transformers, not weights
    sd = {k: v for k, v in sd.items()
          if k.split(".")[-2:] not in (["attn", "bias"], ["attn", "masked_bias"])}
    src = os.path.join(os.path.dirname(path), "config.json")
    if os.path.exists(src):
        with open(src) as f:
            hf = json.load(f)
    else:
        check(n_head, f"{path}: no config.json beside it, so n_head is unknown: copy the model's "
                      f"config.json there (or pass n_head)")
        hf, src = {}, path
    # another architecture (Llama, GPT-Neo, GPT-2 with a classifier head) has other tensors
    kind, arch = hf.get("model_type", "gpt2"), hf.get("architectures") or []
    named = f" ({', '.join(arch)})" if arch else ""
    check(kind == "gpt2" and set(arch) <= {"GPT2LMHeadModel", "GPT2Model"},
          f'{src}: model_type={json.dumps(kind)}{named} is refused: only GPT-2 imports '
          f'(model_type "gpt2", GPT2LMHeadModel)')
    check("wte.weight" in sd, f"{path}: no wte.weight among its tensors "
                              f"({', '.join(sorted(sd)[:3])}, ...): not a GPT-2 checkpoint")
    V, C = sd["wte.weight"].shape
    n_pos, L = sd["wpe.weight"].shape[0], sum(k.endswith(".ln_1.weight") for k in sd)
    H = n_head or hf.get("n_head", 12)  # 12: GPT2Config's default
    # Per option, the values this GPT computes, the first one GPT2Config's default (or what the
    # tensors say). Any other value would import without complaint and give other logits.
    honoured = dict(vocab_size=[V], n_embd=[C], n_layer=[L], n_head=[H],
                    n_positions=[n_pos], n_inner=[None, 4 * C],
                    # gelu_pytorch_tanh is gelu_new's formula (tanh GELU) in one torch kernel
                    activation_function=["gelu_new", "gelu_pytorch_tanh"],
                    layer_norm_epsilon=[1e-5], scale_attn_weights=[True],
                    # it only upcasts attention scores to fp32 under fp16: the same function
                    reorder_and_upcast_attn=[False, True], scale_attn_by_inverse_layer_idx=[False],
                    tie_word_embeddings=[True], add_cross_attention=[False])
    for k, ok in honoured.items():
        v = hf.get(k, ok[0])
        check(v in ok, f"{src}: {k}={json.dumps(v)} is refused: the imported GPT would compute "
                       f"{k}={' or '.join(map(json.dumps, ok))}")
    lm = sd.pop("lm_head.weight", None)
    check(lm is None or torch.equal(lm, sd["wte.weight"]),
          f"{path}: lm_head differs from wte: an untied output embedding is not supported")
    block_size = block_size or n_pos
    check(block_size <= n_pos, f"block_size {block_size} > the {n_pos} positions {path} learned")
    cfg = GPTConfig(block_size=block_size, vocab_size=V, n_embd=C, n_head=H, n_layer=L,
                    bias="h.0.attn.c_attn.bias" in sd)
    sd["wpe.weight"] = sd["wpe.weight"][:block_size]
    if vocab_size and vocab_size > V:  # new rows: GPT-2's init; PAD is only read, never predicted
        extra = torch.randn(vocab_size - V, C, dtype=sd["wte.weight"].dtype) * 0.02
        sd["wte.weight"], cfg.vocab_size = torch.cat([sd["wte.weight"], extra]), vocab_size
    sd = {"transformer." + k: v.t() if k.endswith(CONV1D) else v for k, v in sd.items()}
    sd["lm_head.weight"] = sd["transformer.wte.weight"]
    model = GPT(cfg)
    model.load_state_dict(sd)
    return model


def export_gpt2(model, tokenizer_json, out_dir):
    """Writes out_dir, a folder that transformers' AutoModelForCausalLM.from_pretrained and
    AutoTokenizer.from_pretrained load as they are (each file from its documented schema):
      model.safetensors       GPT-2's layout: Conv1D weights, lm_head tied (stored once)
      config.json             GPT2Config with bos/eos/pad ids (without them transformers assumes
                              50256, past a small vocabulary, and generate never stops at EOS)
      generation_config.json  the same three ids, which generate reads
      tokenizer.json          tokenizer_json, PAD added if absent (as data.Tok does), EOS put first
                              as the BOS every sequence here starts with: tokenizer(" the movie")
                              gives data.encode_prompt's ids
      tokenizer_config.json   EOS (also BOS) and PAD by name, no clean-up of spaces in decode (it
      special_tokens_map.json would turn " ." into "."), no token_type_ids (transformers 4.x
                              returns them by default, and GPT-2 adds them to the input), PAD
                              on the left (batched generate appends every row's next token at
                              the end: a short prompt padded on the right would be continued
                              after its PADs), and
                              data.py's conversation template as the chat_template:
                              apply_chat_template(messages, tokenize=False) gives data.py's text,
                              which tokenizer(text) then encodes BOS first (apply_chat_template's
                              own tokenize=True adds no special tokens, so no BOS)"""
    c = model.config
    check(c.head == "lm" and c.bias, "the GPT-2 layout needs the LM head and biases")
    tk = Tokenizer.from_file(tokenizer_json)
    if tk.token_to_id(PAD) is None:
        tk.add_special_tokens([PAD])
    eos, pad, n = tk.token_to_id(EOS), tk.token_to_id(PAD), tk.get_vocab_size()
    check(eos is not None, f"{tokenizer_json} has no {EOS} token")
    check(n <= c.vocab_size, f"{tokenizer_json} has {n} tokens, the model only {c.vocab_size}")
    tk.post_processor = processors.TemplateProcessing(single=f"{EOS} $A", pair=f"{EOS} $A $B",
                                                      special_tokens=[(EOS, eos)])
    sd = {k: (v.t() if k.endswith(CONV1D) else v).detach().contiguous().cpu()
          for k, v in model.state_dict().items() if k != "lm_head.weight"}
    ids = dict(bos_token_id=eos, eos_token_id=eos, pad_token_id=pad)
    config = dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", vocab_size=c.vocab_size,
                  n_positions=c.block_size, n_embd=c.n_embd, n_layer=c.n_layer, n_head=c.n_head,
                  n_inner=None, activation_function="gelu_new", layer_norm_epsilon=1e-5,
                  scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
                  reorder_and_upcast_attn=False, tie_word_embeddings=True,
                  resid_pdrop=c.dropout, embd_pdrop=c.dropout, attn_pdrop=c.dropout, **ids)
    special = dict(bos_token=EOS, eos_token=EOS, pad_token=PAD)
    # model_input_names: no token_type_ids, which GPT-2 would add to the input as wte rows
    tok_config = dict(tokenizer_class="PreTrainedTokenizerFast", model_max_length=c.block_size,
                      model_input_names=["input_ids", "attention_mask"],
                      clean_up_tokenization_spaces=False, padding_side="left",
                      chat_template=CHAT_TEMPLATE, **special)
    files = {"model.safetensors": save(sd, metadata={"format": "pt"}),  # transformers checks it
             "tokenizer.json": tk.to_str(pretty=True).encode()}
    for name, obj in [("config.json", config), ("generation_config.json", ids),
                      ("tokenizer_config.json", tok_config), ("special_tokens_map.json", special)]:
        files[name] = json.dumps(obj, indent=2).encode()
    os.makedirs(out_dir, exist_ok=True)
    for name, content in files.items():  # each file whole or not at all: a temp file, renamed
        with open(os.path.join(out_dir, name + ".tmp"), "wb") as f:
            f.write(content)
        os.replace(os.path.join(out_dir, name + ".tmp"), os.path.join(out_dir, name))


if __name__ == "__main__":
    import sys
    check(sys.argv[1:2] == ["export"] and len(sys.argv) == 4,
          "usage: python hf.py export SRC.safetensors OUT_DIR")
    src, out = sys.argv[2:]
    tok = os.path.join(os.path.dirname(src), "tokenizer.json")  # every stage keeps one beside it
    check(os.path.isfile(src) and os.path.isfile(tok), f"{src} and {tok} must both exist")
    export_gpt2(load_model(src)[0], tok, out)
    with open(os.path.join(out, "config.json")) as f:
        ids = {k: v for k, v in json.load(f).items() if k.endswith("token_id")}
    print(f"{out}: {' '.join(sorted(os.listdir(out)))} | {ids}")
