// The official `openai` npm client against `kvrelay up`'s OpenAI-compatible HTTP API: a
// streamed chat completion returns the same token ids as `kvrelay generate --colocated` on the
// same prompt, usage is reported, and bad input gets OpenAI-shaped 4xx errors while the server
// keeps serving. Run by ctest (tests/e2e/CMakeLists.txt) with KVRELAY_BIN set.
import { test, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, execFileSync } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import OpenAI from 'openai';

const bin = process.env.KVRELAY_BIN;
assert.ok(bin, 'KVRELAY_BIN must name the kvrelay binary');

function freePort() {
  return new Promise((resolve, reject) => {
    const s = net.createServer();
    s.once('error', reject);
    s.listen(0, '127.0.0.1', () => {
      const { port } = s.address();
      s.close(() => resolve(port));
    });
  });
}

const dataDir = mkdtempSync(path.join(os.tmpdir(), 'kvrelay-openai-'));
const httpPort = await freePort();
// Plain text: this test is about the HTTP API, not about security (tests/security covers TLS).
const up = spawn(bin, ['up', '--insecure', '--gateway-address', '127.0.0.1:0', '--http-address',
                       `127.0.0.1:${httpPort}`, '--data-dir', dataDir],
                 { stdio: ['ignore', 'pipe', 'pipe'] });
let log = '';
up.stdout.on('data', (d) => { log += d; });
up.stderr.on('data', (d) => { log += d; });
await new Promise((resolve, reject) => {
  const timer = setTimeout(() => reject(new Error(`kvrelay up not ready in 90 s:\n${log}`)), 90000);
  const poll = setInterval(() => {
    if (log.includes('gateway http listening on')) {
      clearInterval(poll); clearTimeout(timer); resolve();
    }
  }, 100);
  up.once('exit', (code) => { clearInterval(poll); clearTimeout(timer);
    reject(new Error(`kvrelay up exited ${code}:\n${log}`)); });
});

after(async () => {
  up.kill('SIGTERM');
  await new Promise((resolve) => { up.once('exit', resolve); setTimeout(resolve, 20000); });
  rmSync(dataDir, { recursive: true, force: true });
});

const model = 'model-llama';
const client = new OpenAI({ baseURL: `http://127.0.0.1:${httpPort}/v1`, apiKey: 'unused',
                            maxRetries: 0, timeout: 60000 });

// The byte codec's chat template (gateway/http/openai_server.cc), one token per UTF-8 byte.
function chatPromptIds(messages) {
  let text = '';
  for (const m of messages) text += `<|${m.role}|>\n${m.content}\n`;
  text += '<|assistant|>\n';
  return [...Buffer.from(text, 'utf8')];
}

function colocated(ids, maxTokens) {
  const out = execFileSync(bin, ['generate', '--colocated', '--model', path.join(dataDir, model),
                                 '--tokens', ids.join(','), '--max-tokens', String(maxTokens),
                                 '--json'], { encoding: 'utf8' });
  return JSON.parse(out).tokens;
}

test('models lists the served model', async () => {
  const models = await client.models.list();
  assert.deepEqual(models.data.map((m) => m.id), [model]);
});

test('streamed chat completion equals the co-located reference', async () => {
  const messages = [{ role: 'user', content: 'Tell me about KV caches.' }];
  const stream = await client.chat.completions.create({
    model, messages, max_tokens: 12, temperature: 0, stream: true,
    stream_options: { include_usage: true },
  });
  const ids = [];
  let usage = null;
  let finish = null;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      ids.push(...(c.token_ids ?? []));
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  const prompt = chatPromptIds(messages);
  assert.deepEqual(ids, colocated(prompt, 12));
  assert.equal(finish, 'length');
  assert.equal(usage.prompt_tokens, prompt.length);
  assert.equal(usage.completion_tokens, 12);
  assert.equal(typeof usage.prompt_tokens_details.cached_tokens, 'number');
});

test('a repeated prompt reports cached tokens', async () => {
  const prompt = Array.from({ length: 80 }, (_, i) => (i * 7) % 200 + 1);
  const first = await client.completions.create({ model, prompt, max_tokens: 3, temperature: 0 });
  const second = await client.completions.create({ model, prompt, max_tokens: 3, temperature: 0 });
  assert.deepEqual(second.choices[0].token_ids, first.choices[0].token_ids);
  assert.deepEqual(first.choices[0].token_ids, colocated(prompt, 3));
  assert.ok(second.usage.prompt_tokens_details.cached_tokens >= 64,
            JSON.stringify(second.usage));
});

test('bad input gets OpenAI-shaped errors and the server keeps serving', async () => {
  const cases = [
    [{ model, prompt: 'x', max_tokens: 'many' }, 400, 'max_tokens'],
    [{ model, prompt: 'x', max_tokens: 100000 }, 400, 'max_tokens'],
    [{ model, prompt: 'x', temperature: -1 }, 400, 'temperature'],
    [{ model: 'no-such-model', prompt: 'x' }, 404, 'model'],
    [{ model, prompt: 'x'.repeat(40000) }, 400, 'prompt'],
  ];
  for (const [body, status, param] of cases) {
    await assert.rejects(client.completions.create(body), (e) => {
      assert.equal(e.status, status, JSON.stringify(body).slice(0, 80));
      assert.equal(e.error?.param, param);
      assert.ok(e.error?.message);
      return true;
    });
  }
  const res = await fetch(`http://127.0.0.1:${httpPort}/v1/completions`,
                          { method: 'POST', body: '{not json' });
  assert.equal(res.status, 400);
  assert.match((await res.json()).error.message, /not valid JSON/);
  const ok = await client.completions.create({ model, prompt: 'still here', max_tokens: 2 });
  assert.equal(ok.choices[0].token_ids.length, 2);
});
