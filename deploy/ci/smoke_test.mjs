// The dev overlay, run for real without a cluster: renders deploy/k8s/overlays/dev, and runs
// each rendered pod's containers as local processes on loopback — init containers first, then
// the servers with the exact rendered arguments and --config files from the rendered ConfigMap.
// Only what a cluster would provide is rewritten: pod DNS names and ports become 127.0.0.1 and
// free ports, volume mount paths become per-pod directories, the downward API's pod IP is
// 127.0.0.1. Then: every server passes `kvrelay health` (the probes' check), a Generate through
// the gateway returns the same tokens as `kvrelay generate --colocated` on the same model, a
// request in flight when its decode worker gets SIGTERM (a rolling update) still finishes with
// those tokens, and every server exits 0 well inside its pod's terminationGracePeriodSeconds.
//
// Run: KVRELAY_BIN=build/bin/kvrelay node --test deploy/ci/smoke_test.mjs

import assert from "node:assert/strict";
import { spawn, spawnSync } from "node:child_process";
import fs from "node:fs";
import net from "node:net";
import os from "node:os";
import path from "node:path";
import { after, test } from "node:test";
import YAML from "yaml";
import { DEFAULT_KUBECTL, REPO_ROOT, render } from "./check.mjs";

const KVRELAY = path.resolve(process.env.KVRELAY_BIN ?? path.join(REPO_ROOT, "build/bin/kvrelay"));
const START_ORDER = ["cachestore", "prefill", "decode", "gateway"];
const children = [];
let scratch = null;

after(() => {
  for (const c of children) if (c.exitCode === null && c.signalCode === null) c.kill("SIGKILL");
  if (scratch) fs.rmSync(scratch, { recursive: true, force: true });
});

function freePort() {
  return new Promise((resolve, reject) => {
    const s = net.createServer();
    s.on("error", reject);
    s.listen(0, "127.0.0.1", () => {
      const { port } = s.address();
      s.close(() => resolve(port));
    });
  });
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

function podsOf(objects) {
  const pods = [];
  for (const o of objects) {
    if (o.kind !== "StatefulSet" && o.kind !== "Deployment") continue;
    for (let i = 0; i < (o.spec.replicas ?? 1); ++i) {
      pods.push({
        name: o.kind === "StatefulSet" ? `${o.metadata.name}-${i}` : `${o.metadata.name}-local${i}`,
        dns: o.kind === "StatefulSet" ? `${o.metadata.name}-${i}.${o.spec.serviceName}` : null,
        component: o.spec.template.metadata.labels["app.kubernetes.io/component"],
        spec: o.spec.template.spec,
        claims: (o.spec.volumeClaimTemplates ?? []).map((t) => t.metadata.name),
      });
    }
  }
  return pods;
}

// What a cluster provides, played locally for one pod.
function localizer(pod, pods, objects) {
  const root = path.join(scratch, pod.name);
  const mounts = new Map();  // container mountPath -> local directory
  const rewritePath = (value) => {
    for (const [mp, dir] of mounts) {
      if (value === mp || value.startsWith(mp + "/")) return dir + value.slice(mp.length);
    }
    return value;
  };
  const rewriteAddresses = (value) => value.replace(/([a-z0-9-]+-\d+\.[a-z0-9-]+):(\d+)/g, (all, host) => {
    const target = pods.find((p) => p.dns === host);
    assert.ok(target, `${pod.name}: address ${all} names no rendered pod`);
    return `127.0.0.1:${target.grpcPort}`;
  });
  const rewrite = (key, value) => {
    if (Array.isArray(value)) return value.map((v) => rewrite(key, v));
    let v = String(value);
    // The pod's own DNS name it registers under (its headless Service's record) is loopback here.
    if (key === "host" || key === "transport-host" || key === "advertise-address") v = "127.0.0.1";
    if (key === "port") v = String(pod.grpcPort);
    if (key === "metrics-port") v = String(pod.metricsPort);
    if (key === "http-port") v = String(pod.httpPort);
    return rewritePath(rewriteAddresses(v));
  };
  const mountVolumes = (container) => {
    mounts.clear();
    for (const m of container.volumeMounts ?? []) {
      const dir = path.join(root, "volumes", m.name);
      fs.mkdirSync(dir, { recursive: true });
      mounts.set(m.mountPath.replace(/\/+$/, ""), dir);
      const volume = (pod.spec.volumes ?? []).find((v) => v.name === m.name);
      if (volume?.secret?.secretName === "kvrelay-tenant") {
        fs.writeFileSync(path.join(dir, "tenant-secret"), "smoke-test-tenant-secret\n");
      }
    }
    // ConfigMap files, with what they name localized too.
    for (const m of container.volumeMounts ?? []) {
      const volume = (pod.spec.volumes ?? []).find((v) => v.name === m.name);
      if (!volume?.configMap) continue;
      const cm = objects.find((o) => o.kind === "ConfigMap" && o.metadata.name === volume.configMap.name);
      for (const [file, text] of Object.entries(cm.data)) {
        const config = YAML.parse(text) ?? {};
        const local = {};
        for (const [k, v] of Object.entries(config)) local[k] = rewrite(k, v);
        fs.writeFileSync(path.join(mounts.get(m.mountPath.replace(/\/+$/, "")), file), YAML.stringify(local));
      }
    }
  };
  const argv = (container) => {
    mountVolumes(container);
    const env = { POD_NAME: pod.name, POD_IP: "127.0.0.1" };
    const raw = [...(container.command ?? []).slice(1), ...(container.args ?? [])];
    return raw.map((a, i) => {
      const s = String(a).replace(/\$\((\w+)\)/g, (all, n) => env[n] ?? all);
      if (i === 0 || !s.startsWith("--")) return s;
      const eq = s.indexOf("=");
      return eq < 0 ? s : `${s.slice(0, eq)}=${rewrite(s.slice(2, eq), s.slice(eq + 1))}`;
    });
  };
  const envOf = (container) => {
    const env = { ...process.env };
    for (const e of container.env ?? []) if (e.value !== undefined) env[e.name] = e.value;
    return env;
  };
  return { argv, envOf, mounts };
}

function startServer(pod, container, args, env) {
  const child = spawn(KVRELAY, args, { env, stdio: ["ignore", "pipe", "pipe"] });
  children.push(child);
  const out = { text: "", err: "" };
  child.stdout.on("data", (d) => { out.text += d; });
  child.stderr.on("data", (d) => { out.err += d; });
  return { pod, container, child, out };
}

async function waitHealthy(server, budgetMs) {
  const deadline = Date.now() + budgetMs;
  for (;;) {
    // The dev overlay runs in plain text (insecure: true in its configs), as its probes check.
    const r = spawnSync(KVRELAY, ["health", "--address", `127.0.0.1:${server.pod.grpcPort}`,
                                  "--timeout", "1s", "--insecure"], { encoding: "utf8" });
    if (r.status === 0) return;
    assert.ok(server.child.exitCode === null,
              `${server.pod.name} exited ${server.child.exitCode}: ${server.out.err}`);
    assert.ok(Date.now() < deadline, `${server.pod.name} not SERVING after ${budgetMs} ms: ${r.stderr}`);
    await sleep(200);
  }
}

test("the dev overlay's rendered pods serve a request on loopback and drain on SIGTERM", async () => {
  assert.ok(fs.existsSync(DEFAULT_KUBECTL), `${DEFAULT_KUBECTL} missing: run deploy/ci/setup.sh`);
  assert.ok(fs.existsSync(KVRELAY), `${KVRELAY} missing: build kvrelay first`);
  scratch = fs.mkdtempSync(path.join(os.tmpdir(), "kvrelay-smoke-"));
  const rendered = render(DEFAULT_KUBECTL, path.join(REPO_ROOT, "deploy/k8s/overlays/dev"));
  assert.equal(rendered.error, undefined, rendered.error);
  const pods = podsOf(rendered.objects);
  assert.deepEqual(pods.map((p) => p.component).sort(), ["cachestore", "decode", "gateway", "prefill"]);
  for (const p of pods) {
    p.grpcPort = await freePort();
    p.metricsPort = await freePort();
    p.httpPort = await freePort();
  }

  const servers = [];
  for (const component of START_ORDER) {
    for (const pod of pods.filter((p) => p.component === component)) {
      const local = localizer(pod, pods, rendered.objects);
      for (const init of pod.spec.initContainers ?? []) {
        const r = spawnSync(KVRELAY, local.argv(init), { env: local.envOf(init), encoding: "utf8" });
        assert.equal(r.status, 0, `${pod.name} init ${init.name}: ${r.stderr}`);
      }
      const [container] = pod.spec.containers;
      const server = startServer(pod, container, local.argv(container), local.envOf(container));
      server.local = local;
      servers.push(server);
      const startup = container.startupProbe;
      await waitHealthy(server, Math.min(60000, startup.periodSeconds * startup.failureThreshold * 1000));
      console.log(`${pod.name}: SERVING on 127.0.0.1:${pod.grpcPort} (kvrelay ${local.argv(container).join(" ")})`);
    }
  }

  // A request through the gateway equals the co-located reference on the gateway pod's model.
  const gateway = servers.find((s) => s.pod.component === "gateway");
  const modelDir = gateway.local.mounts.get("/models") + "/tiny-llama";
  const tokens = Array.from({ length: 40 }, (_, i) => (i * 7 + 3) % 200).join(",");
  const viaGateway = spawnSync(KVRELAY, ["generate", "--gateway", `127.0.0.1:${gateway.pod.grpcPort}`,
                                          "--tokens", tokens, "--max-tokens", "6", "--json",
                                          "--insecure"],
                               { encoding: "utf8", timeout: 120000 });
  assert.equal(viaGateway.status, 0, viaGateway.stderr);
  const reference = spawnSync(KVRELAY, ["generate", "--colocated", "--model", modelDir,
                                         "--tokens", tokens, "--max-tokens", "6", "--json"],
                              { encoding: "utf8", timeout: 120000 });
  assert.equal(reference.status, 0, reference.stderr);
  const got = JSON.parse(viaGateway.stdout).tokens;
  const want = JSON.parse(reference.stdout).tokens;
  assert.equal(got.length, 6);
  assert.deepEqual(got, want);
  console.log(`generate through the gateway: ${got.join(",")} (== co-located)`);

  // The OpenAI-compatible HTTP port the gateway Service exposes.
  const models = await fetch(`http://127.0.0.1:${gateway.pod.httpPort}/v1/models`);
  assert.equal(models.status, 200);
  const ids = (await models.json()).data.map((m) => m.id);
  assert.ok(ids.includes("tiny-llama"), `GET /v1/models: ${ids}`);
  console.log(`GET /v1/models on the gateway's http port: ${ids.join(",")}`);

  // A rolling update of the decode worker while it streams: SIGTERM (what the kubelet sends
  // after the preStop sleep) must let the in-flight request finish with the right tokens.
  const decode = servers.find((s) => s.pod.component === "decode");
  const longArgs = ["--tokens", tokens, "--max-tokens", "1500", "--json"];
  const longReference = spawnSync(KVRELAY, ["generate", "--colocated", "--model", modelDir, ...longArgs],
                                  { encoding: "utf8", timeout: 120000 });
  assert.equal(longReference.status, 0, longReference.stderr);
  const inFlight = spawn(KVRELAY, ["generate", "--gateway", `127.0.0.1:${gateway.pod.grpcPort}`, ...longArgs,
                                   "--insecure"],
                         { stdio: ["ignore", "pipe", "pipe"] });
  children.push(inFlight);
  let streamed = "";
  let streamErr = "";
  inFlight.stdout.on("data", (d) => { streamed += d; });
  inFlight.stderr.on("data", (d) => { streamErr += d; });
  const streamDone = new Promise((resolve) => inFlight.on("exit", (code) => resolve(code)));
  const activeDeadline = Date.now() + 30000;
  for (;;) {
    const text = await fetch(`http://127.0.0.1:${decode.pod.metricsPort}/metrics`).then((r) => r.text());
    if (/^kvrelay:decode_active_sequences(\{[^}]*\})? 1\b/m.test(text)) break;
    assert.ok(inFlight.exitCode === null, `the request ended before the decode worker was stopped: ${streamErr}`);
    assert.ok(Date.now() < activeDeadline, "the decode worker never showed the request as active");
    await sleep(10);
  }
  const decodeStopped = Date.now();
  const decodeExit = new Promise((resolve) => decode.child.on("exit", (code, signal) =>
    resolve({ s: decode, code, signal, ms: Date.now() - decodeStopped })));
  decode.child.kill("SIGTERM");
  assert.equal(await streamDone, 0, `the in-flight request failed while decode drained: ${streamErr}`);
  assert.deepEqual(JSON.parse(streamed).tokens, JSON.parse(longReference.stdout).tokens);
  console.log(`in-flight request (1500 tokens) finished while its decode worker drained, == co-located`);

  // Then everything else at once, as `kubectl delete` does after the preStop sleep.
  const started = Date.now();
  const exits = [decodeExit, ...servers.filter((s) => s !== decode).map((s) => new Promise((resolve) => {
    if (s.child.exitCode !== null) resolve({ s, code: s.child.exitCode, ms: 0 });
    else s.child.on("exit", (code, signal) => resolve({ s, code, signal, ms: Date.now() - started }));
  }))];
  for (const s of servers) if (s !== decode) s.child.kill("SIGTERM");
  for (const { s, code, signal, ms } of await Promise.all(exits)) {
    const grace = s.pod.spec.terminationGracePeriodSeconds;
    const pre = s.container.lifecycle?.preStop?.exec?.command;
    const preStop = pre && path.basename(pre[0]) === "sleep" ? Number(pre[1]) : 0;
    assert.equal(code, 0, `${s.pod.name} exited ${code ?? signal} on SIGTERM: ${s.out.err}`);
    assert.ok(ms < (grace - preStop) * 1000, `${s.pod.name} took ${ms} ms to drain, grace ${grace}s - preStop ${preStop}s`);
    console.log(`${s.pod.name}: exit 0 ${ms} ms after SIGTERM (grace ${grace}s, preStop ${preStop}s)`);
  }
});
