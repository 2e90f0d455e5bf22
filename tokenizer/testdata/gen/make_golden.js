// Writes tokenizer golden files (../golden_<model>.json) from the reference implementation
// @lenml/tokenizers (transformers.js tokenizers), pinned by package-lock.json here.
// Usage: cd tokenizer/testdata/gen && npm ci && node make_golden.js
// The C++ tests read only the committed golden files and tokenizer.json copies.
"use strict";
const fs = require("fs");
const path = require("path");
const zlib = require("zlib");

const MODELS = ["llama3", "deepseek_v3", "qwen3", "llama2", "gemma3", "tiny_sp"];
// tokenizer.json files committed (gzip-compressed) under ../models/<model>/: only Qwen3's, whose
// Apache-2.0 licence allows it; the others' licences ask for their agreement texts to travel
// with them, so their golden files are committed and the files come from npm (see README.md).
const COMMITTED = new Set(["qwen3"]);
// Hand-written test tokenizers (../models/<name>/, made by make_tiny_sp.py), run through the
// reference too.
const LOCAL = new Set(["tiny_sp"]);

const pkgDir = (pkg) => path.join(__dirname, "node_modules", pkg);
const pkgJson = (pkg) => JSON.parse(fs.readFileSync(path.join(pkgDir(pkg), "package.json"), "utf8"));

const corpus = JSON.parse(fs.readFileSync(path.join(__dirname, "corpus.json"), "utf8"));

const CHATS = [
  [{ role: "user", content: "Hello!" }],
  [
    { role: "system", content: "You are a helpful assistant." },
    { role: "user", content: "What is 2+2?" },
    { role: "assistant", content: "4" },
    { role: "user", content: "And 3+3? Answer in 日本語." },
  ],
];

for (const model of MODELS) {
  const pkg = LOCAL.has(model) ? `local ${model}` : `@lenml/tokenizer-${model}`;
  let tokenizer;
  if (LOCAL.has(model)) {
    const dir = path.join(__dirname, "..", "models", model);
    tokenizer = require("@lenml/tokenizers").TokenizerLoader.fromPreTrained({
      tokenizerJSON: JSON.parse(fs.readFileSync(path.join(dir, "tokenizer.json"), "utf8")),
      tokenizerConfig: JSON.parse(fs.readFileSync(path.join(dir, "tokenizer_config.json"), "utf8")),
    });
  } else {
    tokenizer = require(pkg).fromPreTrained();
  }
  const cases = corpus.map((text) => {
    const ids = tokenizer.encode(text, { add_special_tokens: false });
    const ids_special = tokenizer.encode(text, { add_special_tokens: true });
    const one = (x) => tokenizer.decode(x, { skip_special_tokens: false });
    return {
      text,
      ids,
      ids_with_special_tokens: ids_special,
      decoded: ids.length ? one(ids) : "",
      decoded_with_special_tokens: ids_special.length ? one(ids_special) : "",
      decoded_skip_special: ids_special.length
        ? tokenizer.decode(ids_special, { skip_special_tokens: true })
        : "",
      // One id at a time: partial UTF-8 sequences decode to U+FFFD.
      decoded_each: ids.map((id) => one([id])),
    };
  });
  const chats = [];
  let template_error = null;
  if (tokenizer.chat_template) {
    try {
      tokenizer.apply_chat_template(CHATS[0], { tokenize: false });
    } catch (e) {
      // The reference's Jinja subset cannot parse some templates (Qwen3's): no chat goldens.
      template_error = String(e.message).slice(0, 200);
    }
  }
  if (tokenizer.chat_template && template_error === null) {
    for (const messages of CHATS) {
      for (const add_generation_prompt of [false, true]) {
        const text = tokenizer.apply_chat_template(messages, {
          tokenize: false,
          add_generation_prompt,
        });
        chats.push({ messages, add_generation_prompt, text });
      }
    }
  }
  const out = {
    reference: `${LOCAL.has(model) ? pkg : `${pkg}@${pkgJson(pkg).version}`} with @lenml/tokenizers@${
      pkgJson("@lenml/tokenizers").version
    }`,
    bos_token: tokenizer.bos_token,
    eos_token: tokenizer.eos_token,
    cases,
    chats,
    template_error,
  };
  fs.writeFileSync(
    path.join(__dirname, "..", `golden_${model}.json`),
    JSON.stringify(out, null, 1) + "\n"
  );
  if (COMMITTED.has(model)) {
    const dir = path.join(__dirname, "..", "models", model);
    fs.mkdirSync(dir, { recursive: true });
    const src = path.join(pkgDir(pkg), "models");
    // mtime 0 keeps the gzip bytes reproducible.
    const json = fs.readFileSync(path.join(src, "tokenizer.json"));
    fs.writeFileSync(path.join(dir, "tokenizer.json.gz"), zlib.gzipSync(json, { level: 9 }));
    fs.copyFileSync(path.join(src, "tokenizer_config.json"), path.join(dir, "tokenizer_config.json"));
  }
  console.log(`${model}: ${cases.length} texts, ${chats.length} chats`);
}
