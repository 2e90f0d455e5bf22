// Offline checks of deploy/ (no cluster, no registry): renders every kustomize target with the
// pinned kubectl, validates every object against the Kubernetes API schemas
// (kubernetes-models), applies the project's policy (probes, resources, securityContext, image
// tags, Secrets, selectors, drain vs grace period, scrape annotations), checks every flag and
// config key a manifest hands to `kvrelay` against the binary itself, and lints the
// Dockerfiles (dockerfile-utils + the project's own checks).
//
// Usage: node deploy/ci/check.mjs [--kvrelay build/bin/kvrelay] [--kubectl PATH]
//          [--deploy-dir deploy] [--target NAME]... [--no-docker] [--list]
// Exit 0 when everything passes; 1 with one line per problem otherwise.

import { spawnSync } from "node:child_process";
import fs from "node:fs";
import { createRequire } from "node:module";
import os from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";
import YAML from "yaml";
import { validate as lintDockerfile } from "dockerfile-utils";

const CI_DIR = path.dirname(fileURLToPath(import.meta.url));
export const REPO_ROOT = path.resolve(CI_DIR, "../..");
export const DEFAULT_KUBECTL = path.join(CI_DIR, ".tools", "kubectl");

// Every Secret the manifests mount: created by the operator (deploy/README.md), never rendered.
const KNOWN_SECRETS = ["kvrelay-tenant", "kvrelay-tls"];
// Capabilities a container may add, and what it must also request to justify it.
const CAPABILITY_NEEDS = { IPC_LOCK: /^rdma\// };
// The restricted Pod Security Standard allows adding only this one.
const RESTRICTED_CAPABILITIES = new Set(["NET_BIND_SERVICE"]);
// A server without a --drain-timeout flag drains for this long (ServiceHostOptions' default).
const SERVICE_HOST_DRAIN_SECONDS = 30;
// Values the downward API would give, for running the binary's own flag parser offline.
const SAMPLE_FIELD_VALUES = {
  "metadata.name": "kvrelay-sample-0",
  "metadata.namespace": "kvrelay",
  "status.podIP": "10.0.0.7",
  "status.hostIP": "10.0.0.1",
  "spec.nodeName": "node-1",
};
const WORKLOAD_KINDS = new Set(["Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"]);

// ---------------------------------------------------------------------------------------------
// Rendering and schema validation.

export function findTargets(deployDir) {
  const k8s = path.join(deployDir, "k8s");
  const targets = [];
  if (fs.existsSync(path.join(k8s, "base", "kustomization.yaml"))) {
    targets.push({ name: "base", dir: path.join(k8s, "base") });
  }
  const overlays = path.join(k8s, "overlays");
  if (fs.existsSync(overlays)) {
    for (const entry of fs.readdirSync(overlays).sort()) {
      if (fs.existsSync(path.join(overlays, entry, "kustomization.yaml"))) {
        targets.push({ name: entry, dir: path.join(overlays, entry) });
      }
    }
  }
  return targets;
}

export function render(kubectl, dir) {
  const r = spawnSync(kubectl, ["kustomize", dir], { encoding: "utf8", maxBuffer: 64 << 20 });
  if (r.error) return { error: `cannot run ${kubectl}: ${r.error.message}` };
  const warnings = (r.stderr || "").trim();
  if (r.status !== 0) return { error: `kubectl kustomize failed: ${warnings}` };
  // A deprecation warning today is a render failure in a later kustomize: treat it as one now.
  if (warnings) return { error: `kubectl kustomize warned: ${warnings}` };
  const objects = [];
  for (const doc of YAML.parseAllDocuments(r.stdout)) {
    if (doc.errors.length) return { error: `rendered YAML: ${doc.errors[0].message}` };
    const obj = doc.toJS();
    if (obj) objects.push(obj);
  }
  return { objects };
}

const modelCache = new Map();
async function modelClass(apiVersion, kind) {
  const key = `${apiVersion}/${kind}`;
  if (!modelCache.has(key)) {
    let cls = null;
    try {
      const mod = await import(`kubernetes-models/${apiVersion}`);
      cls = mod[kind] ?? null;
    } catch {
      cls = null;
    }
    modelCache.set(key, cls);
  }
  return modelCache.get(key);
}

// Unknown fields. The schemas let unknown properties through (as the OpenAPI documents do), but
// an API server with strict field validation (kubectl's default since 1.27) refuses them, and a
// misspelled optional field would otherwise be silently dropped. kubernetes-models' type
// declarations list every field of every type: walk the object along them (fields whose type is
// declared inline, such as a StatefulSet's volumeClaimTemplates, are not descended).
const MODELS_DIR = path.dirname(createRequire(import.meta.url).resolve("kubernetes-models/package.json"));
const declCache = new Map();

function declarationOf(file) {
  if (!declCache.has(file)) {
    let decl = null;
    if (fs.existsSync(file)) {
      const text = fs.readFileSync(file, "utf8");
      const imports = new Map();
      for (const m of text.matchAll(/^import \{ (\w+) \} from "([^"]+)";$/gm)) {
        const target = m[2].startsWith(".")
          ? path.resolve(path.dirname(file), m[2] + ".d.ts")
          : path.join(MODELS_DIR, "..", m[2] + ".d.ts");
        imports.set(m[1], target);
      }
      const body = text.match(/^export interface I\w+(?: extends [\w, ]+)? \{\n([\s\S]*?)^\}/m);
      if (body) {
        const props = new Map();
        for (const m of body[1].matchAll(/^    "([^"]+)"\??: (.*?);?$/gm)) props.set(m[1], m[2]);
        decl = { props, imports };
      }
    }
    declCache.set(file, decl);
  }
  return declCache.get(file);
}

function unknownFields(value, file, where, report) {
  if (!value || typeof value !== "object" || Array.isArray(value)) return;
  const decl = declarationOf(file);
  if (!decl) return;
  for (const [key, child] of Object.entries(value)) {
    const type = decl.props.get(key);
    if (type === undefined) {
      report(`unknown field ${where}.${key} (strict field validation refuses it)`);
      continue;
    }
    const array = type.match(/^Array<(I\w+)>$/);
    const named = array ? array[1] : (type.match(/^(I\w+)$/) ?? [])[1];
    const target = named && decl.imports.get(named);
    if (!target) continue;  // a scalar, an enum, a map or a type alias
    if (array && Array.isArray(child)) {
      child.forEach((item, i) => unknownFields(item, target, `${where}.${key}[${i}]`, report));
    } else if (!array) {
      unknownFields(child, target, `${where}.${key}`, report);
    }
  }
}

async function validateSchema(obj, report) {
  const cls = await modelClass(obj.apiVersion, obj.kind);
  if (!cls) {
    report(`no Kubernetes schema for apiVersion ${obj.apiVersion} kind ${obj.kind}`);
    return;
  }
  try {
    new cls(obj).validate();
  } catch (e) {
    report(`schema: ${e.message}`);
  }
  const root = path.join(MODELS_DIR, obj.apiVersion, `${obj.kind}.d.ts`);
  if (!declarationOf(root)) report(`no type declaration ${path.relative(MODELS_DIR, root)} for the unknown-field check`);
  else unknownFields(obj, root, obj.kind, report);
}

// ---------------------------------------------------------------------------------------------
// Helpers over rendered objects.

const ref = (o) => `${o.kind}/${o.metadata?.name}`;

function podSpecOf(obj) {
  if (obj.kind === "Pod") return { spec: obj.spec, meta: obj.metadata };
  if (WORKLOAD_KINDS.has(obj.kind)) {
    return { spec: obj.spec?.template?.spec, meta: obj.spec?.template?.metadata };
  }
  if (obj.kind === "CronJob") {
    const t = obj.spec?.jobTemplate?.spec?.template;
    return { spec: t?.spec, meta: t?.metadata };
  }
  return null;
}

function labelsMatch(selector, labels) {
  if (!selector) return false;
  const ml = selector.matchLabels ?? (selector.matchExpressions ? {} : selector);
  for (const [k, v] of Object.entries(ml)) if (labels?.[k] !== v) return false;
  for (const e of selector.matchExpressions ?? []) {
    const has = labels && Object.hasOwn(labels, e.key);
    const val = labels?.[e.key];
    if (e.operator === "In" && !(has && e.values.includes(val))) return false;
    if (e.operator === "NotIn" && has && e.values.includes(val)) return false;
    if (e.operator === "Exists" && !has) return false;
    if (e.operator === "DoesNotExist" && has) return false;
  }
  return true;
}

function isEmptySelector(sel) {
  return !sel || (Object.keys(sel.matchLabels ?? {}).length === 0 &&
                  (sel.matchExpressions ?? []).length === 0);
}

function imageTagProblem(image) {
  if (!image) return "has no image";
  if (image.includes("@sha256:")) return null;
  const last = image.slice(image.lastIndexOf("/") + 1);
  const colon = last.lastIndexOf(":");
  if (colon < 0) return `image ${image} has no tag (pin a version)`;
  if (last.slice(colon + 1) === "latest") return `image ${image} uses the latest tag`;
  return null;
}

function parseDurationSeconds(text) {
  if (text === undefined || text === null) return null;
  let total = 0;
  let matched = "";
  for (const m of String(text).matchAll(/(\d+(?:\.\d+)?)(ms|h|m|s)/g)) {
    const n = Number(m[1]);
    total += m[2] === "h" ? n * 3600 : m[2] === "m" ? n * 60 : m[2] === "s" ? n : n / 1000;
    matched += m[0];
  }
  return matched === String(text) ? total : null;
}

// ---------------------------------------------------------------------------------------------
// kvrelay's own flag parser, run offline.

export class KvrelayBinary {
  constructor(binary) {
    this.binary = binary;
    this.helpCache = new Map();
  }

  run(args) {
    return spawnSync(this.binary, args, { encoding: "utf8", timeout: 20000 });
  }

  // {flags: Map name -> default text} from `kvrelay <command> --help`, or {error}.
  help(command) {
    if (!this.helpCache.has(command)) {
      const r = this.run([command, "--help"]);
      if (r.error) {
        this.helpCache.set(command, { error: `cannot run ${this.binary}: ${r.error.message}` });
      } else if (r.status !== 0) {
        this.helpCache.set(command, {
          error: `\`kvrelay ${command} --help\` exited ${r.status}: ${(r.stderr || "").trim()}`,
        });
      } else {
        const flags = new Map();
        for (const line of r.stdout.split("\n")) {
          const m = line.match(/^\s+--([a-z0-9][a-z0-9-]*)\s*(.*)$/);
          if (!m || m[1] === "help") continue;
          const d = m[2].match(/\(default: ([^)]*)\)\s*$/);
          flags.set(m[1], d ? d[1] : null);
        }
        this.helpCache.set(command, { flags });
      }
    }
    return this.helpCache.get(command);
  }
}

// Splits `--name=value` / `--name value` arguments. Returns [{name, value, raw}] or throws.
function splitFlags(args) {
  const out = [];
  for (let i = 0; i < args.length; ++i) {
    const a = String(args[i]);
    if (!a.startsWith("--")) throw new Error(`argument '${a}' is not a --flag`);
    const eq = a.indexOf("=");
    if (eq > 0) {
      out.push({ name: a.slice(2, eq), value: a.slice(eq + 1) });
    } else if (i + 1 < args.length && !String(args[i + 1]).startsWith("--")) {
      out.push({ name: a.slice(2), value: String(args[++i]) });
    } else {
      out.push({ name: a.slice(2), value: "true" });
    }
  }
  return out;
}

function expandEnv(text, env) {
  return String(text).replace(/\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g, (all, name) =>
    Object.hasOwn(env, name) ? env[name] : all);
}

function sampleEnv(container) {
  const env = {};
  for (const e of container.env ?? []) {
    if (e.value !== undefined) env[e.name] = e.value;
    else if (e.valueFrom?.fieldRef) {
      env[e.name] = SAMPLE_FIELD_VALUES[e.valueFrom.fieldRef.fieldPath] ?? "sample";
    } else env[e.name] = "sample";
  }
  return env;
}

// The file a path inside a container comes from: {configMap, key} / {secret, key} / {volume}.
function fileSource(podSpec, container, filePath) {
  let best = null;
  for (const m of container.volumeMounts ?? []) {
    const mp = m.mountPath.replace(/\/+$/, "");
    if (filePath === mp || filePath.startsWith(mp + "/")) {
      if (!best || mp.length > best.mp.length) best = { mp, mount: m };
    }
  }
  if (!best) return null;
  const volume = (podSpec.volumes ?? []).find((v) => v.name === best.mount.name);
  if (!volume) return null;
  const key = filePath.slice(best.mp.length + 1);
  if (volume.configMap) return { configMap: volume.configMap.name, key, volume };
  if (volume.secret) return { secret: volume.secret.secretName, key, volume };
  return { volume, key };
}

// ---------------------------------------------------------------------------------------------
// The checks.

export async function checkObjects(objects, ctx) {
  const errors = [];
  ctx.configsUsed = new Set();
  const byKind = (k) => objects.filter((o) => o.kind === k);
  const pods = objects.map((o) => ({ obj: o, pod: podSpecOf(o) })).filter((x) => x.pod?.spec);
  const namespaces = byKind("Namespace");
  const nsOf = (o) => o.metadata?.namespace ?? "default";
  const podsIn = (ns) => pods.filter((p) => nsOf(p.obj) === ns);

  for (const obj of objects) {
    const report = (msg) => errors.push(`${ref(obj)}: ${msg}`);
    await validateSchema(obj, report);
    if (obj.kind === "Secret") {
      report("Secrets are never part of the manifests: create them out of band (deploy/README.md)");
    }
    if (obj.kind === "ConfigMap") {
      for (const [key, value] of Object.entries(obj.data ?? {})) {
        if (/-----BEGIN [A-Z ]*(PRIVATE KEY|CERTIFICATE)-----/.test(value)) {
          report(`data.${key} holds key or certificate material: use a Secret`);
        }
        if (/(^|[-_.])(secret|password|token|key)$/i.test(key.replace(/\.[a-z]+$/, ""))) {
          report(`data.${key}: a secret-looking key belongs in a Secret`);
        }
      }
    }
  }

  // Workloads and their containers.
  for (const { obj, pod } of pods) {
    const report = (msg) => errors.push(`${ref(obj)}: ${msg}`);
    const spec = pod.spec;
    const podLabels = pod.meta?.labels ?? {};
    if (obj.spec?.selector && !labelsMatch(obj.spec.selector, podLabels)) {
      report("spec.selector does not match the pod template's labels");
    }
    const volumeNames = new Set();
    for (const v of spec.volumes ?? []) {
      if (volumeNames.has(v.name)) report(`volume ${v.name} is defined twice`);
      volumeNames.add(v.name);
      if (v.secret && !KNOWN_SECRETS.includes(v.secret.secretName)) {
        report(`volume ${v.name} mounts Secret ${v.secret.secretName}, which deploy/README.md ` +
               `does not tell operators to create (known: ${KNOWN_SECRETS.join(", ")})`);
      }
      if (v.configMap && !objects.some((o) => o.kind === "ConfigMap" &&
                                              o.metadata.name === v.configMap.name)) {
        report(`volume ${v.name} refers to ConfigMap ${v.configMap.name}, which is not rendered`);
      }
      if (v.persistentVolumeClaim) {
        const claim = v.persistentVolumeClaim.claimName;
        if (!objects.some((o) => o.kind === "PersistentVolumeClaim" && o.metadata.name === claim)) {
          report(`volume ${v.name} refers to PersistentVolumeClaim ${claim}, which is not rendered`);
        }
      }
    }
    for (const t of obj.spec?.volumeClaimTemplates ?? []) volumeNames.add(t.metadata?.name);
    if (obj.kind === "StatefulSet") {
      const svc = objects.find((o) => o.kind === "Service" && o.metadata.name === obj.spec.serviceName);
      if (!svc) report(`serviceName ${obj.spec.serviceName} is not a rendered Service`);
      else if (svc.spec?.clusterIP !== "None") {
        report(`serviceName ${obj.spec.serviceName} must be a headless Service (clusterIP: None)`);
      }
    }
    const podRunAsNonRoot = spec.securityContext?.runAsNonRoot;
    const podSeccomp = spec.securityContext?.seccompProfile?.type;
    const scrape = pod.meta?.annotations ?? {};
    const all = [...(spec.initContainers ?? []).map((c) => ({ c, init: true })),
                 ...(spec.containers ?? []).map((c) => ({ c, init: false }))];
    for (const { c, init } of all) {
      const where = `${init ? "init container" : "container"} ${c.name}`;
      const creport = (msg) => report(`${where}: ${msg}`);
      const tagProblem = imageTagProblem(c.image);
      if (tagProblem) creport(tagProblem);
      const r = c.resources ?? {};
      for (const kind of ["requests", "limits"]) {
        for (const res of ["cpu", "memory"]) {
          if (r[kind]?.[res] === undefined) creport(`no resources.${kind}.${res}`);
        }
      }
      const sc = c.securityContext ?? {};
      if ((sc.runAsNonRoot ?? podRunAsNonRoot) !== true) creport("runAsNonRoot is not true");
      if (sc.allowPrivilegeEscalation !== false) creport("allowPrivilegeEscalation is not false");
      if (sc.readOnlyRootFilesystem !== true) creport("readOnlyRootFilesystem is not true");
      if (sc.privileged === true) creport("runs privileged");
      if (!(sc.capabilities?.drop ?? []).includes("ALL")) creport("does not drop ALL capabilities");
      if ((sc.seccompProfile?.type ?? podSeccomp) !== "RuntimeDefault") {
        creport("seccompProfile is not RuntimeDefault");
      }
      for (const cap of sc.capabilities?.add ?? []) {
        const need = CAPABILITY_NEEDS[cap];
        if (!need) {
          creport(`adds capability ${cap}, which no kvrelay overlay needs`);
        } else if (!Object.keys(r.limits ?? {}).some((k) => need.test(k))) {
          creport(`adds ${cap} without the resource that needs it (${need})`);
        }
      }
      const envNames = new Set();
      for (const e of c.env ?? []) {
        if (envNames.has(e.name)) creport(`env ${e.name} is set twice`);
        envNames.add(e.name);
        if (e.value !== undefined && /(SECRET|PASSWORD|TOKEN|PRIVATE_KEY)/i.test(e.name)) {
          creport(`env ${e.name} inlines a secret: use a Secret`);
        }
      }
      for (const m of c.volumeMounts ?? []) {
        if (!volumeNames.has(m.name)) creport(`mounts volume ${m.name}, which the pod does not define`);
      }
      if (!init) {
        const grpcPort = (c.ports ?? []).find((p) => p.name === "grpc")?.containerPort;
        if (grpcPort === undefined) creport("has no container port named grpc");
        for (const probe of ["startupProbe", "readinessProbe", "livenessProbe"]) {
          const p = c[probe];
          // A grpc probe, or (the kubelet's gRPC probe cannot do mutual TLS) an exec probe that
          // runs `kvrelay health --address=127.0.0.1:<grpc port>` with the pod's TLS flags.
          const health = p?.exec?.command ?? [];
          const address = health.find((a) => String(a).startsWith("--address="));
          const execPort = address ? Number(String(address).split(":").pop()) : undefined;
          if (!p) creport(`has no ${probe}`);
          else if (p.grpc) {
            if (grpcPort !== undefined && p.grpc.port !== grpcPort) {
              creport(`${probe} checks port ${p.grpc.port}, the grpc port is ${grpcPort}`);
            }
          } else if (!(String(health[0] ?? "").endsWith("/kvrelay") && health[1] === "health")) {
            creport(`${probe} is neither a grpc probe nor an exec of \`kvrelay health\``);
          } else if (grpcPort !== undefined && execPort !== grpcPort) {
            creport(`${probe} checks ${address ?? "no --address"}, the grpc port is ${grpcPort}`);
          } else if (!health.includes("--insecure") &&
                     !["--tls-cert=", "--tls-key=", "--tls-ca="].every(
                         (f) => health.some((a) => String(a).startsWith(f)))) {
            creport(`${probe} runs kvrelay health without --tls-cert/--tls-key/--tls-ca or --insecure`);
          }
        }
        const metricsPort = (c.ports ?? []).find((p) => p.name === "metrics")?.containerPort;
        if (metricsPort === undefined) creport("has no container port named metrics");
        if (scrape["prometheus.io/scrape"] !== "true") {
          report('pod template lacks the annotation prometheus.io/scrape: "true"');
        } else if (String(scrape["prometheus.io/port"]) !== String(metricsPort)) {
          report(`prometheus.io/port is ${scrape["prometheus.io/port"]}, the metrics port is ${metricsPort}`);
        }
      }
      await checkKvrelayContainer({ obj, spec, c, init, objects, ctx, report: creport, errors });
    }
    const kvrelayImages = new Set(all.filter(({ c }) => runsKvrelay(c)).map(({ c }) => c.image));
    if (kvrelayImages.size > 1) {
      report(`containers run kvrelay from different images (${[...kvrelayImages].join(", ")})`);
    }
    if (spec.hostNetwork || all.some(({ c }) =>
        (c.securityContext?.capabilities?.add ?? []).some((cap) => !RESTRICTED_CAPABILITIES.has(cap)))) {
      const ns = namespaces.find((n) => n.metadata.name === nsOf(obj));
      const level = ns?.metadata?.labels?.["pod-security.kubernetes.io/enforce"];
      if (level !== "privileged") {
        report(`uses host networking or extra capabilities, but namespace ${nsOf(obj)} enforces ` +
               `Pod Security "${level ?? "(unset)"}": the pods would be refused`);
      }
    }
  }

  // Every config file in a ConfigMap is some server's --config, so each of its keys was checked
  // against that server's flags above.
  for (const cm of byKind("ConfigMap")) {
    for (const key of Object.keys(cm.data ?? {})) {
      if (!ctx.configsUsed.has(`${cm.metadata.name}/${key}`)) {
        errors.push(`${ref(cm)}: ${key} is no container's --config file, so its keys are unchecked`);
      }
    }
  }

  // Selectors: every Service, PDB, NetworkPolicy and HPA must point at something rendered.
  for (const svc of byKind("Service")) {
    const report = (msg) => errors.push(`${ref(svc)}: ${msg}`);
    if (isEmptySelector({ matchLabels: svc.spec?.selector })) {
      report("has no selector (every Service must select kvrelay pods)");
      continue;
    }
    const selected = podsIn(nsOf(svc)).filter((p) => labelsMatch(svc.spec.selector, p.pod.meta?.labels));
    if (selected.length === 0) {
      report(`selector ${JSON.stringify(svc.spec.selector)} selects no pod`);
      continue;
    }
    for (const port of svc.spec.ports ?? []) {
      const target = port.targetPort ?? port.port;
      const found = selected.some((p) => (p.pod.spec.containers ?? []).some((c) =>
        (c.ports ?? []).some((cp) => cp.name === target || cp.containerPort === target)));
      if (!found) report(`port ${port.name ?? port.port}: targetPort ${target} is no container port of the selected pods`);
    }
  }
  for (const pdb of byKind("PodDisruptionBudget")) {
    if (!podsIn(nsOf(pdb)).some((p) => labelsMatch(pdb.spec?.selector, p.pod.meta?.labels))) {
      errors.push(`${ref(pdb)}: selector selects no pod`);
    }
  }
  // A rolling restart takes one worker of a role at a time (SIGTERM drain, restart under the
  // same node id): each worker StatefulSet needs a PDB with maxUnavailable 1 over its pods.
  for (const sts of byKind("StatefulSet")) {
    const labels = sts.spec?.template?.metadata?.labels ?? {};
    if (!["prefill", "decode"].includes(labels["app.kubernetes.io/component"])) continue;
    const budgets = byKind("PodDisruptionBudget").filter(
      (pdb) => nsOf(pdb) === nsOf(sts) && labelsMatch(pdb.spec?.selector, labels));
    if (!budgets.some((pdb) => pdb.spec?.maxUnavailable === 1)) {
      errors.push(`${ref(sts)}: no PodDisruptionBudget with maxUnavailable 1 selects its pods ` +
                  "(rollouts drain one worker at a time)");
    }
  }
  for (const hpa of byKind("HorizontalPodAutoscaler")) {
    const t = hpa.spec?.scaleTargetRef ?? {};
    if (!objects.some((o) => o.kind === t.kind && o.metadata.name === t.name && nsOf(o) === nsOf(hpa))) {
      errors.push(`${ref(hpa)}: scaleTargetRef ${t.kind}/${t.name} is not rendered`);
    }
  }
  for (const np of byKind("NetworkPolicy")) {
    const report = (msg) => errors.push(`${ref(np)}: ${msg}`);
    const ns = nsOf(np);
    if (!isEmptySelector(np.spec?.podSelector) &&
        !podsIn(ns).some((p) => labelsMatch(np.spec.podSelector, p.pod.meta?.labels))) {
      report("podSelector selects no pod");
    }
    const peers = [...(np.spec?.ingress ?? []).flatMap((r) => r.from ?? []),
                   ...(np.spec?.egress ?? []).flatMap((r) => r.to ?? [])];
    for (const peer of peers) {
      if (peer.podSelector && !peer.namespaceSelector && !isEmptySelector(peer.podSelector) &&
          !podsIn(ns).some((p) => labelsMatch(peer.podSelector, p.pod.meta?.labels))) {
        report(`peer podSelector ${JSON.stringify(peer.podSelector.matchLabels)} selects no pod`);
      }
    }
  }
  return errors;
}

// The kvrelay arguments of a container (after the binary), or null when it runs something else.
function kvrelayArgs(c) {
  const command = c.command ?? [];
  const imageName = (c.image ?? "").replace(/[@:][^/]*$/, "").split("/").pop();
  if (command.length > 0) {
    if (path.basename(String(command[0])) !== "kvrelay") return null;
    return [...command.slice(1), ...(c.args ?? [])];
  }
  // No command: the image's ENTRYPOINT (kvrelay, deploy/docker/Dockerfile) runs.
  return imageName.startsWith("kvrelay") ? [...(c.args ?? [])] : null;
}
const runsKvrelay = (c) => kvrelayArgs(c) !== null;

// Flags, config keys and addresses of one container that runs kvrelay.
async function checkKvrelayContainer({ obj, spec, c, init, objects, ctx, report }) {
  const args = kvrelayArgs(c);
  if (args === null) return;
  if (args.length === 0) {
    report("runs kvrelay without a command");
    return;
  }
  const subcommand = String(args[0]);
  const help = ctx.kvrelay.help(subcommand);
  if (help.error) {
    report(help.error);
    return;
  }
  let flags;
  try {
    flags = splitFlags(args.slice(1));
  } catch (e) {
    report(`kvrelay ${subcommand}: ${e.message}`);
    return;
  }
  const effective = new Map();
  let configText = null;
  let configPath = null;
  for (const f of flags) {
    if (f.name === "config") {
      configPath = f.value;
      continue;
    }
    if (!help.flags.has(f.name)) {
      report(`kvrelay ${subcommand} has no flag --${f.name} (see \`kvrelay ${subcommand} --help\`)`);
    }
  }
  if (configPath !== null) {
    const src = fileSource(spec, c, configPath);
    if (!src?.configMap) {
      report(`--config ${configPath} is not a file of a mounted ConfigMap`);
    } else {
      const cm = objects.find((o) => o.kind === "ConfigMap" && o.metadata.name === src.configMap);
      configText = cm?.data?.[src.key];
      ctx.configsUsed.add(`${src.configMap}/${src.key}`);
      if (configText === undefined) {
        report(`--config ${configPath}: ConfigMap ${src.configMap} has no key ${src.key}`);
      } else {
        let parsed;
        try {
          parsed = YAML.parse(configText) ?? {};
        } catch (e) {
          report(`--config ${configPath}: not YAML: ${e.message}`);
        }
        if (parsed && typeof parsed === "object") {
          for (const [key, value] of Object.entries(parsed)) {
            if (!help.flags.has(key)) {
              report(`ConfigMap ${src.configMap} key ${src.key}: '${key}' is not a flag of ` +
                     `kvrelay ${subcommand}`);
            }
            effective.set(key, Array.isArray(value) ? value.map(String) : String(value));
          }
        }
      }
    }
  }
  for (const f of flags) if (f.name !== "config") effective.set(f.name, f.value);

  // The binary's own parser over the whole command line (env from the downward API filled in
  // with sample values, the ConfigMap file written out): catches bad values, flags a command
  // does not take, and a --config the command refuses.
  const env = sampleEnv(c);
  const argv = [subcommand];
  let tmp = null;
  if (configText !== null && configText !== undefined) {
    tmp = fs.mkdtempSync(path.join(os.tmpdir(), "kvrelay-deploy-"));
    const file = path.join(tmp, "config.yaml");
    fs.writeFileSync(file, configText);
    argv.push(`--config=${file}`);
  }
  for (const f of flags) if (f.name !== "config") argv.push(`--${f.name}=${expandEnv(f.value, env)}`);
  argv.push("--help");
  const run = ctx.kvrelay.run(argv);
  if (tmp) fs.rmSync(tmp, { recursive: true, force: true });
  if (run.status !== 0) {
    report(`\`kvrelay ${argv.join(" ")}\` (config from the ConfigMap) exited ${run.status}: ` +
           `${(run.stderr || run.stdout || "").trim()}`);
  }
  if (init) return;

  // Cross-checks between the server's flags and the pod around it.
  const port = (name) => (c.ports ?? []).find((p) => p.name === name)?.containerPort;
  const value = (name) => effective.get(name) ?? help.flags.get(name) ?? null;
  if (help.flags.has("port") && String(value("port")) !== String(port("grpc"))) {
    report(`--port is ${value("port")}, the container's grpc port is ${port("grpc")}`);
  }
  if (help.flags.has("metrics-port") && String(value("metrics-port")) !== String(port("metrics"))) {
    report(`--metrics-port is ${value("metrics-port")}, the container's metrics port is ${port("metrics")}`);
  }
  const httpPort = effective.get("http-port");
  if (httpPort !== undefined && httpPort !== "-1" && String(httpPort) !== String(port("http"))) {
    report(`--http-port is ${httpPort}, the container's http port is ${port("http")}`);
  }
  if (help.flags.has("host") && value("host") !== "0.0.0.0") {
    report(`--host is ${value("host")}: probes and Services need 0.0.0.0`);
  }
  if (help.flags.has("node-id")) {
    const nodeId = effective.get("node-id");
    const fromPodName = (c.env ?? []).some((e) => nodeId === `$(${e.name})` &&
      e.valueFrom?.fieldRef?.fieldPath === "metadata.name");
    if (!fromPodName) report("--node-id must be $(VAR) with VAR = the pod name (downward API): node ids must be unique");
  }
  if (help.flags.has("transport-host")) {
    const host = effective.get("transport-host");
    const fromPodIp = (c.env ?? []).some((e) => host === `$(${e.name})` &&
      e.valueFrom?.fieldRef?.fieldPath === "status.podIP");
    if (!fromPodIp) report("--transport-host must be $(VAR) with VAR = the pod IP (downward API): the data plane advertises it");
  }
  for (const fileFlag of ["tenant-secret-file"]) {
    const file = effective.get(fileFlag);
    if (file !== undefined) {
      const src = fileSource(spec, c, file);
      if (!src?.secret) report(`--${fileFlag} ${file} is not a file of a mounted Secret`);
    }
  }
  const model = effective.get("model");
  if (model !== undefined && !fileSource(spec, c, model)) {
    report(`--model ${model} is on no mounted volume`);
  }
  for (const name of ["cachestore", "prefill", "decode"]) {
    const v = effective.get(name);
    if (v === undefined) continue;
    const list = Array.isArray(v) ? v : String(v).split(",").filter(Boolean);
    if (name !== "cachestore" && list.length > 0) {
      report(`--${name} lists workers: these manifests discover workers from the store's ` +
             "registry (kubectl scale is the whole scale-out); drop the list");
      continue;
    }
    checkAddresses({ name, list, objects, nsOfObj: obj.metadata?.namespace, report });
  }
  if (help.flags.has("discovery-interval") && effective.get("cachestore") === undefined) {
    report("the gateway has no --cachestore: it discovers its workers from the store's registry");
  }
  if (help.flags.has("advertise-address") && help.flags.has("transport-host")) {  // a worker
    checkAdvertisedName({ obj, c, advertised: effective.get("advertise-address"), objects, report });
  }

  // Termination grace > preStop sleep + drain.
  let drain = SERVICE_HOST_DRAIN_SECONDS;
  if (help.flags.has("drain-timeout")) {
    drain = parseDurationSeconds(effective.get("drain-timeout") ?? help.flags.get("drain-timeout"));
    if (drain === null) report(`cannot read --drain-timeout ${effective.get("drain-timeout")}`);
  }
  const pre = c.lifecycle?.preStop?.exec?.command ?? [];
  const preStopSleep = path.basename(String(pre[0] ?? "")) === "sleep" ? Number(pre[1]) : 0;
  const grace = spec.terminationGracePeriodSeconds ?? 30;
  if (drain !== null && !(grace > drain + preStopSleep)) {
    report(`terminationGracePeriodSeconds ${grace} must exceed preStop ${preStopSleep}s + drain ${drain}s`);
  }
}

// A store address must name a pod the render creates: <sts>-<i>.<headless svc>:<port> with
// i < replicas, or <svc>:<port>.
function checkAddresses({ name, list, objects, nsOfObj, report }) {
  for (const address of list) {
    const m = String(address).match(/^([a-z0-9.-]+):(\d+)$/);
    if (!m) {
      report(`--${name} entry '${address}' is not HOST:PORT`);
      continue;
    }
    const [host, portText] = [m[1], m[2]];
    const parts = host.split(".");
    let svc = null;
    let sts = null;
    let ordinal = null;
    const first = parts[0].match(/^(.*)-(\d+)$/);
    if (parts.length >= 2 && first) {
      svc = parts[1];
      sts = objects.find((o) => o.kind === "StatefulSet" && o.metadata.name === first[1] &&
                               o.spec.serviceName === svc);
      ordinal = Number(first[2]);
      if (!sts) {
        report(`--${name} entry ${address}: no StatefulSet ${first[1]} behind Service ${svc}`);
        continue;
      }
      if (ordinal >= (sts.spec.replicas ?? 1)) {
        report(`--${name} entry ${address}: ${sts.metadata.name} has only ${sts.spec.replicas ?? 1} replicas`);
      }
    } else {
      svc = parts[0];
    }
    const service = objects.find((o) => o.kind === "Service" && o.metadata.name === svc &&
                                        (o.metadata.namespace ?? "default") === (nsOfObj ?? "default"));
    if (!service) {
      report(`--${name} entry ${address}: no Service ${svc} in the render`);
    } else if (!(service.spec.ports ?? []).some((p) => String(p.port) === portText)) {
      report(`--${name} entry ${address}: Service ${svc} has no port ${portText}`);
    }
  }
}

// A worker registers under --advertise-address and gateways dial that name and verify its
// certificate against it: it must be the pod's own stable DNS name, $(POD_NAME).<the
// StatefulSet's headless Service>, published before the pod is ready (a registered worker that
// does not resolve yet would look down to every gateway).
function checkAdvertisedName({ obj, c, advertised, objects, report }) {
  const podNameVar = (c.env ?? []).find((e) => e.valueFrom?.fieldRef?.fieldPath === "metadata.name");
  const service = obj.kind === "StatefulSet" ? obj.spec.serviceName : null;
  const want = podNameVar && service ? `$(${podNameVar.name}).${service}` : null;
  if (want === null || advertised !== want) {
    report(`--advertise-address is ${advertised ?? "unset"}: want ${want ?? "$(POD_NAME).<headless Service>"} ` +
           "(the name gateways discover and verify)");
    return;
  }
  const svc = objects.find((o) => o.kind === "Service" && o.metadata.name === service);
  if (svc && !(svc.spec.clusterIP === "None" && svc.spec.publishNotReadyAddresses === true)) {
    report(`Service ${service} must be headless with publishNotReadyAddresses: true ` +
           "(registered workers must resolve before they are ready)");
  }
}

// ---------------------------------------------------------------------------------------------
// Dockerfiles.

function dockerInstructions(text) {
  const lines = text.split("\n");
  const out = [];
  let current = null;
  for (let i = 0; i < lines.length; ++i) {
    const line = lines[i];
    if (current === null) {
      if (/^\s*(#|$)/.test(line)) continue;
      current = { line: i + 1, text: "" };
    } else if (/^\s*#/.test(line)) {
      continue;
    }
    const cont = /\\\s*$/.test(line);
    current.text += (current.text ? " " : "") + line.replace(/\\\s*$/, "").trim();
    if (!cont) {
      const m = current.text.match(/^(\S+)\s*(.*)$/);
      out.push({ line: current.line, keyword: m[1].toUpperCase(), args: m[2] });
      current = null;
    }
  }
  return out;
}

function dockerignorePatterns(root) {
  const file = path.join(root, ".dockerignore");
  if (!fs.existsSync(file)) return null;
  return fs.readFileSync(file, "utf8").split("\n").map((l) => l.trim())
    .filter((l) => l && !l.startsWith("#"));
}

function ignoredByDockerignore(patterns, rel) {
  let ignored = false;
  for (const raw of patterns) {
    const negate = raw.startsWith("!");
    const p = (negate ? raw.slice(1) : raw).replace(/^\/+/, "").replace(/\/+$/, "");
    const re = new RegExp("^" + p.split("**").map((s) =>
      s.replace(/[.+^${}()|[\]\\]/g, "\\$&").replace(/\*/g, "[^/]*").replace(/\?/g, "[^/]"))
      .join(".*") + "(/.*)?$");
    if (re.test(rel)) ignored = !negate;
  }
  return ignored;
}

export function checkDockerfile(file, root) {
  const errors = [];
  const rel = path.relative(root, file);
  const report = (line, msg) => errors.push(`${rel}:${line}: ${msg}`);
  const text = fs.readFileSync(file, "utf8");
  const E = 2;
  const diagnostics = lintDockerfile(text, {
    deprecatedMaintainer: E, directiveCasing: E, emptyContinuationLine: E, instructionCasing: E,
    instructionCmdMultiple: E, instructionEntrypointMultiple: E, instructionHealthcheckMultiple: E,
    instructionJSONInSingleQuotes: E, instructionWorkdirRelative: E,
  });
  for (const d of diagnostics) report(d.range.start.line + 1, `dockerfile-utils: ${d.message}`);

  const instructions = dockerInstructions(text);
  const argDefaults = {};
  const stages = [];
  for (const ins of instructions) {
    if (ins.keyword === "ARG") {
      const m = ins.args.match(/^([A-Za-z_][A-Za-z0-9_]*)(?:=(.*))?$/);
      if (m && m[2] !== undefined && stages.length === 0) argDefaults[m[1]] = m[2];
      if (stages.length) stages[stages.length - 1].instructions.push(ins);
      continue;
    }
    if (ins.keyword === "FROM") {
      const m = ins.args.match(/^(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?$/i);
      const image = m[1].replace(/\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?/g, (a, n) => argDefaults[n] ?? a);
      const stage = { name: m[2] ?? String(stages.length), image, line: ins.line, instructions: [] };
      const known = stages.some((s) => s.name === image);
      if (!known) {
        const problem = imageTagProblem(image);
        if (problem) report(ins.line, `base ${problem}`);
      }
      stages.push(stage);
      continue;
    }
    if (!stages.length) {
      report(ins.line, `${ins.keyword} before the first FROM`);
      continue;
    }
    stages[stages.length - 1].instructions.push(ins);
  }
  if (stages.length < 2) {
    report(1, "not multi-stage: build and runtime stages expected");
    return errors;
  }
  const patterns = dockerignorePatterns(root);
  if (!patterns) report(1, ".dockerignore is missing at the build context (repository root)");

  // Files the build reads from the context: they must exist and not be ignored.
  for (const stage of stages) {
    for (const ins of stage.instructions) {
      if (ins.keyword !== "COPY" && ins.keyword !== "ADD") continue;
      const words = ins.args.split(/\s+/);
      if (words.some((w) => w.startsWith("--from="))) continue;
      const sources = words.filter((w) => !w.startsWith("--")).slice(0, -1);
      for (const src of sources) {
        const norm = path.normalize(src).replace(/^\/+/, "");
        if (norm === "." || norm === "") continue;
        if (!fs.existsSync(path.join(root, norm))) report(ins.line, `${ins.keyword} source ${src} does not exist`);
        else if (patterns && ignoredByDockerignore(patterns, norm)) {
          report(ins.line, `${ins.keyword} source ${src} is excluded by .dockerignore`);
        }
      }
    }
  }
  // Scripts the RUN steps call from the source tree.
  for (const stage of stages) {
    for (const ins of stage.instructions.filter((i) => i.keyword === "RUN")) {
      for (const m of ins.args.matchAll(/(?:^|[\s;&|(])(?:\/src\/)?((?:scripts|deploy)\/[A-Za-z0-9_./-]+\.sh)\b/g)) {
        const script = path.join(root, m[1]);
        if (!fs.existsSync(script)) report(ins.line, `RUN calls ${m[1]}, which does not exist`);
        else if ((fs.statSync(script).mode & 0o111) === 0) report(ins.line, `${m[1]} is not executable`);
      }
    }
  }
  // The build stage: the project's own setup and build scripts, building the kvrelay target the
  // README builds (scripts/build.sh -> $BUILD_DIR/bin/kvrelay).
  const runs = (stage) => stage.instructions.filter((i) => i.keyword === "RUN").map((i) => i.args).join("\n");
  const build = stages.find((s) => /scripts\/build\.sh/.test(runs(s)));
  const final = stages[stages.length - 1];
  if (!build) {
    report(1, "no stage runs scripts/build.sh (the README's build)");
  } else {
    const text = runs(build);
    if (!/scripts\/setup\.sh/.test(text)) report(build.line, `stage ${build.name} does not run scripts/setup.sh`);
    const targets = text.match(/TARGETS=("?)([^"\s]+)\1/);
    if (targets && !targets[2].split(/\s+/).includes("kvrelay")) {
      report(build.line, `stage ${build.name} builds TARGETS=${targets[2]}, not kvrelay`);
    }
    const buildDir = (text.match(/BUILD_DIR=(\S+)/) ?? [null, "build"])[1];
    const binary = path.posix.join(buildDir, "bin", "kvrelay");
    const copies = final.instructions.filter((i) => i.keyword === "COPY" &&
      i.args.includes(`--from=${build.name}`));
    const copiesBinary = copies.some((i) => {
      const src = i.args.split(/\s+/).filter((w) => !w.startsWith("--"))[0];
      return path.posix.normalize(src) === path.posix.normalize(binary.startsWith("/") ? binary :
        path.posix.join(build.instructions.filter((x) => x.keyword === "WORKDIR").pop()?.args ?? "/", binary));
    });
    if (!copiesBinary) report(final.line, `the runtime stage does not copy ${binary} from stage ${build.name}`);
    if (final === build) report(final.line, "the runtime stage is the build stage");
  }
  const user = final.instructions.filter((i) => i.keyword === "USER").pop();
  if (!user) report(final.line, "the runtime stage has no USER (runs as root)");
  else {
    const uid = user.args.split(":")[0];
    if (!/^\d+$/.test(uid) || uid === "0") {
      report(user.line, `USER ${user.args}: want a numeric non-zero uid (runAsNonRoot can verify it)`);
    }
  }
  if (!final.instructions.some((i) => i.keyword === "HEALTHCHECK" && !/^NONE\b/i.test(i.args))) {
    report(final.line, "the runtime stage has no HEALTHCHECK");
  }
  const entry = final.instructions.filter((i) => i.keyword === "ENTRYPOINT").pop();
  if (!entry || !/(^|[\/"\s[])kvrelay"?\s*\]?\s*$/.test(entry.args)) {
    report(final.line, "the runtime stage's ENTRYPOINT is not the kvrelay binary");
  }
  return errors;
}

// ---------------------------------------------------------------------------------------------

export async function runChecks({ deployDir = path.join(REPO_ROOT, "deploy"), root = REPO_ROOT,
                                  kubectl = DEFAULT_KUBECTL, kvrelay, only = [], docker = true,
                                  log = () => {} }) {
  const errors = [];
  const rendered = {};
  const ctx = { kvrelay: new KvrelayBinary(kvrelay) };
  const readme = path.join(deployDir, "README.md");
  const readmeText = fs.existsSync(readme) ? fs.readFileSync(readme, "utf8") : "";
  if (!readmeText) errors.push("deploy/README.md is missing");
  for (const secret of KNOWN_SECRETS) {
    if (readmeText && !readmeText.includes(secret)) {
      errors.push(`deploy/README.md does not say how to create Secret ${secret}`);
    }
  }
  let targets = findTargets(deployDir);
  if (targets.length === 0) errors.push(`no kustomization under ${deployDir}/k8s`);
  if (only.length) targets = targets.filter((t) => only.includes(t.name));
  for (const t of targets) {
    const r = render(kubectl, t.dir);
    if (r.error) {
      errors.push(`${t.name}: ${r.error}`);
      continue;
    }
    rendered[t.name] = r.objects;
    const found = await checkObjects(r.objects, ctx);
    errors.push(...found.map((e) => `${t.name}: ${e}`));
    log(`${found.length ? "FAIL" : "ok  "} ${t.name}: ${r.objects.length} objects` +
        `${found.length ? `, ${found.length} problems` : ""}`);
  }
  if (docker) {
    const dockerDir = path.join(deployDir, "docker");
    const files = fs.existsSync(dockerDir)
      ? fs.readdirSync(dockerDir).filter((f) => /^Dockerfile(\..+)?$/.test(f) && !f.endsWith(".dockerignore"))
      : [];
    if (files.length === 0) errors.push("deploy/docker has no Dockerfile");
    for (const f of files.sort()) {
      const found = checkDockerfile(path.join(dockerDir, f), root);
      errors.push(...found);
      log(`${found.length ? "FAIL" : "ok  "} docker/${f}`);
      if (!readmeText.includes(`deploy/docker/${f} `) && !readmeText.includes(`deploy/docker/${f}\n`)) {
        errors.push(`deploy/README.md does not show how to build deploy/docker/${f}`);
      }
    }
  }
  return { errors, rendered, targets };
}

async function main(argv) {
  const opts = { kvrelay: path.join(REPO_ROOT, "build", "bin", "kvrelay"), only: [], docker: true };
  let list = false;
  for (let i = 0; i < argv.length; ++i) {
    const a = argv[i];
    if (a === "--kvrelay") opts.kvrelay = argv[++i];
    else if (a === "--kubectl") opts.kubectl = argv[++i];
    else if (a === "--deploy-dir") opts.deployDir = path.resolve(argv[++i]);
    else if (a === "--target") opts.only.push(argv[++i]);
    else if (a === "--no-docker") opts.docker = false;
    else if (a === "--list") list = true;
    else {
      console.error(`check.mjs: unknown argument ${a}`);
      return 2;
    }
  }
  opts.kubectl ??= DEFAULT_KUBECTL;
  if (!fs.existsSync(opts.kubectl)) {
    console.error(`check.mjs: ${opts.kubectl} is missing: run deploy/ci/setup.sh`);
    return 1;
  }
  if (!fs.existsSync(opts.kvrelay)) {
    console.error(`check.mjs: ${opts.kvrelay} is missing: build kvrelay first (scripts/build.sh)`);
    return 1;
  }
  const { errors, rendered } = await runChecks({ ...opts, log: (l) => console.log(l) });
  if (list) {
    for (const [name, objects] of Object.entries(rendered)) {
      console.log(`\n${name}:`);
      for (const o of objects) console.log(`  ${o.kind.padEnd(24)} ${o.metadata.name}`);
    }
  }
  for (const e of errors) console.log(`error: ${e}`);
  console.log(errors.length ? `deploy checks: ${errors.length} problems` : "deploy checks: all passed");
  return errors.length ? 1 : 0;
}

if (process.argv[1] && path.resolve(process.argv[1]) === fileURLToPath(import.meta.url)) {
  process.exitCode = await main(process.argv.slice(2));
}
