// The deploy checks must fail on broken manifests: each case copies deploy/ (and what the
// Dockerfiles read) into a temporary tree, breaks one thing the way a careless edit would, and
// expects check.mjs to name it. The unbroken copy must pass, so a failure is the mutation's.
//
// Run: KVRELAY_BIN=build/bin/kvrelay node --test deploy/ci/broken_test.mjs

import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { after, before, test } from "node:test";
import { fileURLToPath } from "node:url";
import YAML from "yaml";
import { DEFAULT_KUBECTL, REPO_ROOT, runChecks } from "./check.mjs";

const KVRELAY = path.resolve(process.env.KVRELAY_BIN ?? path.join(REPO_ROOT, "build/bin/kvrelay"));
const CHECK = path.join(path.dirname(fileURLToPath(import.meta.url)), "check.mjs");
let scratch;

before(() => {
  assert.ok(fs.existsSync(DEFAULT_KUBECTL), `${DEFAULT_KUBECTL} missing: run deploy/ci/setup.sh`);
  assert.ok(fs.existsSync(KVRELAY), `${KVRELAY} missing: build kvrelay first`);
  scratch = fs.mkdtempSync(path.join(os.tmpdir(), "kvrelay-broken-"));
});
after(() => fs.rmSync(scratch, { recursive: true, force: true }));

// A copy of what the checks read: deploy/ (without the CI tools) and the files the Dockerfiles
// take from the repository root.
function copyTree(name) {
  const root = path.join(scratch, name);
  fs.cpSync(path.join(REPO_ROOT, "deploy"), path.join(root, "deploy"), {
    recursive: true,
    filter: (src) => !/deploy\/ci\/(node_modules|\.tools)(\/|$)/.test(src),
  });
  fs.mkdirSync(path.join(root, "scripts"));
  for (const f of ["setup.sh", "build.sh"]) {
    fs.copyFileSync(path.join(REPO_ROOT, "scripts", f), path.join(root, "scripts", f));
    fs.chmodSync(path.join(root, "scripts", f), 0o755);
  }
  fs.copyFileSync(path.join(REPO_ROOT, ".dockerignore"), path.join(root, ".dockerignore"));
  return root;
}

function edit(root, rel, fn) {
  const file = path.join(root, rel);
  const before = fs.readFileSync(file, "utf8");
  const after = fn(before);
  assert.notEqual(after, before, `the mutation of ${rel} changed nothing`);
  fs.writeFileSync(file, after);
}

function editYamlDocs(root, rel, fn) {
  edit(root, rel, (text) => YAML.parseAllDocuments(text).map((d) => {
    const obj = d.toJS();
    fn(obj);
    return YAML.stringify(obj);
  }).join("---\n"));
}

async function check(root, only, docker = false) {
  const { errors } = await runChecks({
    deployDir: path.join(root, "deploy"), root, kvrelay: KVRELAY, only, docker,
  });
  return errors;
}

async function expectFailure(name, only, mutate, expected, docker = false) {
  const root = copyTree(name);
  mutate(root);
  const errors = await check(root, only, docker);
  assert.ok(errors.length > 0, `${name}: the checks passed a broken manifest`);
  assert.ok(errors.some((e) => expected.test(e)),
            `${name}: no error matches ${expected}; got:\n${errors.join("\n")}`);
  console.log(`${name}: caught: ${errors.find((e) => expected.test(e))}`);
}

test("the unbroken copy passes (so every failure below is its mutation's)", async () => {
  const errors = await check(copyTree("control"), ["base", "dev"], true);
  assert.deepEqual(errors, []);
});

test("a renamed flag fails against `kvrelay prefill --help`", async () => {
  await expectFailure("renamed-flag", ["base"], (root) =>
    edit(root, "deploy/k8s/base/prefill.yaml", (t) => t.replace("--transport-host=$(POD_IP)", "--transport-hostname=$(POD_IP)")),
  /kvrelay prefill has no flag --transport-hostname/);
});

test("a ConfigMap config key the binary does not take fails", async () => {
  await expectFailure("config-key", ["base"], (root) =>
    edit(root, "deploy/k8s/base/config/prefill.yaml", (t) => t.replace("cache-slots:", "cache-slot:")),
  /'cache-slot' is not a flag of kvrelay prefill/);
});

test("a config file no server reads fails (its keys would go unchecked)", async () => {
  await expectFailure("unused-config", ["base"], (root) => {
    fs.writeFileSync(path.join(root, "deploy/k8s/base/config/router.yaml"), "data-dirr: /var/lib/kvrelay\n");
    edit(root, "deploy/k8s/base/kustomization.yaml", (t) => t.replace("  - config/decode.yaml\n", "  - config/decode.yaml\n  - config/router.yaml\n"));
  }, /router\.yaml is no container's --config file/);
});

test("a config value the binary's parser refuses fails", async () => {
  await expectFailure("config-value", ["base"], (root) =>
    edit(root, "deploy/k8s/base/config/decode.yaml", (t) => t.replace("max-batch: 32", "max-batch: lots")),
  /kvrelay decode --config=.*exited 2/);
});

test("a dropped readiness probe fails", async () => {
  await expectFailure("dropped-probe", ["base"], (root) =>
    editYamlDocs(root, "deploy/k8s/base/decode.yaml", (o) => {
      if (o.kind === "StatefulSet") delete o.spec.template.spec.containers[0].readinessProbe;
    }),
  /StatefulSet\/kvrelay-decode: container decode: has no readinessProbe/);
});

test("a misspelled field fails (strict field validation)", async () => {
  await expectFailure("misspelled-field", ["base"], (root) =>
    edit(root, "deploy/k8s/base/gateway.yaml", (t) => t.replace("topologySpreadConstraints:", "topologySpreadConstraint:")),
  /unknown field Deployment\.spec\.template\.spec\.topologySpreadConstraint\b/);
});

test("an image tagged latest fails", async () => {
  await expectFailure("latest-tag", ["base"], (root) =>
    edit(root, "deploy/k8s/base/kustomization.yaml", (t) => t.replace("newTag: 0.1.0", "newTag: latest")),
  /uses the latest tag/);
});

test("an inlined Secret fails", async () => {
  await expectFailure("inlined-secret", ["base"], (root) => {
    fs.writeFileSync(path.join(root, "deploy/k8s/base/tenant-secret.yaml"),
                     "apiVersion: v1\nkind: Secret\nmetadata:\n  name: kvrelay-tenant\n" +
                     "stringData:\n  tenant-secret: hunter2\n");
    edit(root, "deploy/k8s/base/kustomization.yaml", (t) => t.replace("- gateway.yaml\n", "- gateway.yaml\n- tenant-secret.yaml\n"));
  }, /Secret\/kvrelay-tenant: Secrets are never part of the manifests/);
});

test("a Service that selects no pod fails", async () => {
  await expectFailure("service-selector", ["base"], (root) =>
    editYamlDocs(root, "deploy/k8s/base/gateway.yaml", (o) => {
      if (o.kind === "Service") o.spec.selector["app.kubernetes.io/component"] = "gatewy";
    }),
  /Service\/kvrelay-gateway: selector .* selects no pod/);
});

test("a grace period shorter than the drain fails", async () => {
  await expectFailure("short-grace", ["base"], (root) =>
    edit(root, "deploy/k8s/base/gateway.yaml", (t) => t.replace("terminationGracePeriodSeconds: 45", "terminationGracePeriodSeconds: 20")),
  /terminationGracePeriodSeconds 20 must exceed preStop 5s \+ drain 30s/);
});

test("a worker budget that lets a rollout take two workers at once fails", async () => {
  await expectFailure("pdb-two", ["base"], (root) =>
    edit(root, "deploy/k8s/base/decode.yaml", (t) => t.replace(/maxUnavailable: 1\n/, "maxUnavailable: 2\n")),
  /StatefulSet\/kvrelay-decode: no PodDisruptionBudget with maxUnavailable 1/);
});

test("a static worker list in the gateway's config fails", async () => {
  await expectFailure("static-list", ["dev"], (root) =>
    edit(root, "deploy/k8s/overlays/dev/config/gateway.yaml",
         (t) => t + "decode:\n- kvrelay-decode-0.kvrelay-decode:50051\n"),
  /--decode lists workers: these manifests discover workers from the store's registry/);
});

test("a worker that does not register under its pod DNS name fails", async () => {
  await expectFailure("advertise", ["base"], (root) =>
    edit(root, "deploy/k8s/base/decode.yaml",
         (t) => t.replace("--advertise-address=$(POD_NAME).kvrelay-decode", "--advertise-address=$(POD_IP)")),
  /--advertise-address is \$\(POD_IP\): want \$\(POD_NAME\)\.kvrelay-decode/);
});

test("a Dockerfile COPY of a missing file and a malformed HEALTHCHECK fail", async () => {
  const root = copyTree("dockerfile");
  edit(root, "deploy/docker/Dockerfile", (t) => t
    .replace("COPY scripts/setup.sh", "COPY scripts/install.sh")
    .replace("--interval=10s", "--interval=often"));
  const errors = await check(root, ["base"], true);
  assert.ok(errors.some((e) => /COPY source scripts\/install\.sh does not exist/.test(e)), errors.join("\n"));
  assert.ok(errors.some((e) => /dockerfile-utils: .*often/.test(e)), errors.join("\n"));
});

test("check.mjs exits non-zero on a broken tree (what CI sees)", () => {
  const root = copyTree("exit-code");
  edit(root, "deploy/k8s/base/prefill.yaml", (t) => t.replace("--node-id=$(POD_NAME)", "--node=$(POD_NAME)"));
  const r = spawnSync(process.execPath, [CHECK, "--kvrelay", KVRELAY, "--deploy-dir",
                      path.join(root, "deploy"), "--target", "base", "--no-docker"],
                      { encoding: "utf8" });
  assert.equal(r.status, 1, r.stdout + r.stderr);
  assert.match(r.stdout, /kvrelay prefill has no flag --node\b/);
  assert.match(r.stdout, /--node-id must be \$\(VAR\) with VAR = the pod name/);
});
