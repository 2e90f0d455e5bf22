#!/usr/bin/python3
"""Writes ../models/tiny_sp/: a tiny SentencePiece-style BPE tokenizer with byte fallback,
hand-written for the tests (no model's data). It exercises Prepend/Replace normalization, merges,
<0xNN> byte fallback, unk + fuse_unk (bytes 0xF0-0xF4 have no token, so 4-byte characters such
as emoji are unknown), TemplateProcessing and the Replace/ByteFallback/Fuse/Strip decoders."""
import json
import os

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "models", "tiny_sp")
specials = ["<unk>", "<s>", "</s>"]
vocab = {t: i for i, t in enumerate(specials)}
for b in range(256):
    if 0xF0 <= b <= 0xF4:
        continue
    vocab[f"<0x{b:02X}>"] = len(vocab)
for c in "▁abcdefghijklmnopqrstuvwxyzTHEQ,.!?'0123456789-日本語":
    vocab.setdefault(c, len(vocab))
merge_pairs = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a"), ("i", "n"), ("▁", "i"), ("e", "r"),
               ("o", "n"), ("▁", "c"), ("a", "t"), ("▁c", "at"), ("▁", "s"), ("▁i", "n"), ("r", "e"),
               ("▁", "▁"), ("▁▁", "▁▁"), ("日", "本"), ("日本", "語"), ("1", "2"), ("o", "r")]
merges = []
for a, b in merge_pairs:
    vocab.setdefault(a + b, len(vocab))
    merges.append(f"{a} {b}")
added = [{"id": vocab[t], "content": t, "single_word": False, "lstrip": False, "rstrip": False,
          "normalized": False, "special": True} for t in specials]
tok = {
    "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
    "normalizer": {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
    "pre_tokenizer": None,
    "post_processor": {"type": "TemplateProcessing",
                       "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                  {"Sequence": {"id": "A", "type_id": 0}}],
                       "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                {"Sequence": {"id": "A", "type_id": 0}},
                                {"Sequence": {"id": "B", "type_id": 1}}],
                       "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
    "decoder": {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
    "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
              "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True,
              "vocab": vocab, "merges": merges},
}
os.makedirs(OUT, exist_ok=True)
with open(os.path.join(OUT, "tokenizer.json"), "w") as f:
    json.dump(tok, f, ensure_ascii=False, indent=1)
with open(os.path.join(OUT, "tokenizer_config.json"), "w") as f:
    json.dump({"add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
               "clean_up_tokenization_spaces": False, "legacy": True,
               "tokenizer_class": "LlamaTokenizer"}, f, indent=1)
