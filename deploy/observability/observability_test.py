#!/usr/bin/python3
"""Checks deploy/observability against real processes (ctest: deploy_observability_test).

1. promtool: `check rules` on rules.yml and alerts.yml, `test rules` on alerts_test.yml,
   `check config` on the configuration written in step 4.
2. Offline: every alert has its data selectors in checks.yml; k8s/prometheusrule.yaml holds
   exactly the groups of rules.yml and alerts.yml; the PodMonitor and ServiceMonitor select the
   pods and Services of deploy/k8s/base and name a port they have.
3. A local cluster: a real etcd, `kvrelay up --insecure` with the cache store on it (--etcd, so
   the HA families exist), 2 prefill workers (so one pulls a prefix from the other) and 1
   decode worker.
4. A real Prometheus on loopback (free port, temporary storage, 1 s scrape and rule
   evaluation) with prometheus.yml's job and labels, its targets replaced by the cluster's
   metrics addresses, and the rule files.
5. Traffic: `kvrelay bench-serve`, bounded in count and time.
6. Through /api/v1/query: every dashboard target, every recording rule (its expression and the
   recorded series), every alert expression (must parse) and its checks.yml selectors: each
   must succeed and, but for alert expressions, return at least one series. /api/v1/rules: no
   rule has an evaluation error and no alert fires. One line per query with its number of
   series.

Exit 0 on success, 1 on a failure, 77 (ctest SKIP_RETURN_CODE) when prometheus, promtool or
etcd is not installed.

Usage: observability_test.py --kvrelay PATH
       observability_test.py --write-prometheusrule   (regenerates k8s/prometheusrule.yaml)
"""
import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PROMETHEUS = "/usr/bin/prometheus"
PROMTOOL = "/usr/bin/promtool"
ETCD = "/usr/bin/etcd"
SKIP = 77
DEADLINE = None  # time.monotonic() bound of the whole run (--deadline-s)

# Grafana's variables as the test sets them: every model, a rate window over several scrapes.
GRAFANA_VARS = {"$__rate_interval": "1m", "$model_name": ".*"}

PROMETHEUSRULE_HEADER = """\
# prometheus-operator: the recording rules and alerts of ../rules.yml and ../alerts.yml as a
# PrometheusRule. Generated: edit those files, then run
#   deploy/observability/observability_test.py --write-prometheusrule
# (deploy_observability_test fails while this file and they differ).
"""


def load_yaml(name):
    with open(os.path.join(HERE, name), encoding="utf-8") as f:
        return yaml.safe_load(f)


def rule_groups():
    return load_yaml("rules.yml")["groups"] + load_yaml("alerts.yml")["groups"]


def prometheusrule():
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "kvrelay", "labels": {"app.kubernetes.io/name": "kvrelay"}},
        "spec": {"groups": rule_groups()},
    }


def write_prometheusrule():
    path = os.path.join(HERE, "k8s", "prometheusrule.yaml")
    with open(path, "w", encoding="utf-8") as f:
        f.write(PROMETHEUSRULE_HEADER)
        yaml.safe_dump(prometheusrule(), f, sort_keys=False, width=100)
    print(f"wrote {path}")


class Failures:
    def __init__(self):
        self.lines = []

    def add(self, line):
        self.lines.append(line)
        print(f"FAIL: {line}", flush=True)


def run_promtool(fail, tmp):
    for args in (["check", "rules", "rules.yml", "alerts.yml"],
                 ["test", "rules", "alerts_test.yml"]):
        r = subprocess.run([PROMTOOL] + args, cwd=HERE, capture_output=True, text=True,
                           timeout=60)
        print(f"promtool {' '.join(args)}: exit {r.returncode}", flush=True)
        if r.returncode != 0:
            fail.add(f"promtool {' '.join(args)}:\n{r.stdout}{r.stderr}")


def check_offline(fail):
    alerts = [r["alert"] for g in load_yaml("alerts.yml")["groups"] for r in g["rules"]]
    checks = load_yaml("checks.yml")["alerts"]
    for a in alerts:
        if not checks.get(a):
            fail.add(f"checks.yml: alert {a} has no selectors to check for data")
    for a in checks:
        if a not in alerts:
            fail.add(f"checks.yml: {a} is not an alert of alerts.yml")
    committed = load_yaml(os.path.join("k8s", "prometheusrule.yaml"))
    if committed != prometheusrule():
        fail.add("k8s/prometheusrule.yaml differs from rules.yml + alerts.yml "
                 "(run observability_test.py --write-prometheusrule)")
    # The monitors against the manifests they scrape.
    workloads, services = [], []
    for name in sorted(os.listdir(os.path.join(REPO, "deploy", "k8s", "base"))):
        if not name.endswith(".yaml"):
            continue
        with open(os.path.join(REPO, "deploy", "k8s", "base", name), encoding="utf-8") as f:
            for doc in yaml.safe_load_all(f):
                if not doc:
                    continue
                if doc["kind"] in ("Deployment", "StatefulSet"):
                    workloads.append(doc)
                elif doc["kind"] == "Service":
                    services.append(doc)
    pod = load_yaml(os.path.join("k8s", "podmonitor.yaml"))
    svc = load_yaml(os.path.join("k8s", "servicemonitor.yaml"))

    def selects(selector, labels):
        return all(labels.get(k) == v for k, v in selector["matchLabels"].items())

    pod_port = pod["spec"]["podMetricsEndpoints"][0]["port"]
    components = set()
    for w in workloads:
        tmpl = w["spec"]["template"]
        name = w["metadata"]["name"]
        if not selects(pod["spec"]["selector"], tmpl["metadata"]["labels"]):
            fail.add(f"k8s/podmonitor.yaml does not select {name}'s pods")
        ports = [p.get("name") for c in tmpl["spec"]["containers"] for p in c.get("ports", [])]
        if pod_port not in ports:
            fail.add(f"{name}: no container port named {pod_port} (podmonitor.yaml)")
        components.add(tmpl["metadata"]["labels"].get("app.kubernetes.io/component"))
    svc_port = svc["spec"]["endpoints"][0]["port"]
    for s in services:
        name = s["metadata"]["name"]
        if not selects(svc["spec"]["selector"], s["metadata"]["labels"]):
            fail.add(f"k8s/servicemonitor.yaml does not select Service {name}")
        if svc_port not in [p.get("name") for p in s["spec"]["ports"]]:
            fail.add(f"Service {name}: no port named {svc_port} (servicemonitor.yaml)")
    if components != {"cachestore", "prefill", "decode", "gateway"}:
        fail.add(f"deploy/k8s/base components {sorted(components)}: expected the four roles")
    print(f"offline: {len(alerts)} alerts, {len(workloads)} workloads, {len(services)} Services "
          "checked", flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode("utf-8")


def wait_for(what, predicate, limit_s):
    end = min(time.monotonic() + limit_s, DEADLINE)
    if time.monotonic() >= DEADLINE:
        raise TimeoutError(f"the run's --deadline-s passed before {what}")
    while time.monotonic() < end:
        try:
            if predicate():
                return True
        except OSError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"timed out waiting for {what}")


def query(prom, expr):
    url = f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        body = json.loads(http_get(url))
    except urllib.error.HTTPError as e:  # 400: a parse or evaluation error, JSON body
        body = json.loads(e.read().decode("utf-8"))
    return body


def stop(proc, name, grace_s=15):
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        print(f"{name} did not stop in {grace_s} s; killing it", flush=True)
        proc.kill()
        proc.wait()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--kvrelay")
    parser.add_argument("--write-prometheusrule", action="store_true")
    parser.add_argument("--deadline-s", type=float, default=85,
                        help="bound of the whole run (below ctest's TIMEOUT)")
    args = parser.parse_args()
    global DEADLINE
    DEADLINE = time.monotonic() + args.deadline_s
    if args.write_prometheusrule:
        write_prometheusrule()
        return 0
    for tool, package in ((PROMETHEUS, "prometheus"), (PROMTOOL, "prometheus"),
                          (ETCD, "etcd-server")):
        if not os.access(tool, os.X_OK):
            print(f"SKIP: {package} not installed ({tool} missing; scripts/setup.sh installs it)")
            return SKIP
    if not args.kvrelay:
        parser.error("--kvrelay is required")

    fail = Failures()
    tmp = tempfile.mkdtemp(prefix="kvrelay-observability-")
    etcd = up = prom = None
    logs = {}
    try:
        run_promtool(fail, tmp)
        check_offline(fail)

        # --- 3. etcd and the cluster. ---
        etcd_client, etcd_peer = free_port(), free_port()
        logs["etcd"] = open(os.path.join(tmp, "etcd.log"), "w+", encoding="utf-8")
        etcd = subprocess.Popen(
            [ETCD, "--data-dir", os.path.join(tmp, "etcd"),
             "--listen-client-urls", f"http://127.0.0.1:{etcd_client}",
             "--advertise-client-urls", f"http://127.0.0.1:{etcd_client}",
             "--listen-peer-urls", f"http://127.0.0.1:{etcd_peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{etcd_peer}",
             "--initial-cluster", f"default=http://127.0.0.1:{etcd_peer}",
             "--log-level", "warn"],
            stdout=logs["etcd"], stderr=subprocess.STDOUT)
        wait_for("etcd", lambda: json.loads(
            http_get(f"http://127.0.0.1:{etcd_client}/health")).get("health") == "true", 20)

        logs["up"] = open(os.path.join(tmp, "up.log"), "w+", encoding="utf-8")
        up = subprocess.Popen(
            [args.kvrelay, "up", "--insecure", "--prefill", "2", "--decode", "1",
             "--gateway-address", "127.0.0.1:0", "--http-address", "",
             "--data-dir", os.path.join(tmp, "up"),
             "--cachestore-args", f"--etcd 127.0.0.1:{etcd_client} --etcd-lease-ttl 2s",
             # By load alone: requests land on the prefill worker that does not hold their
             # prefix, which then pulls it (the link-rate families) or recomputes it.
             "--gateway-args", "--prefix-routing=false"],
            stdout=logs["up"], stderr=subprocess.STDOUT)

        def up_log():
            logs["up"].flush()
            with open(os.path.join(tmp, "up.log"), encoding="utf-8") as f:
                return f.read()

        def ready():
            if up.poll() is not None:
                raise RuntimeError(f"kvrelay up exited {up.returncode}:\n{up_log()[-3000:]}")
            return "kvrelay up: ready;" in up_log()
        wait_for("kvrelay up to be ready", ready, 60)
        text = up_log()
        # "  prefill-0    127.0.0.1:34455        metrics 127.0.0.1:42985        pid 9669"
        endpoints = re.findall(r"^  (\S+)\s+(\S+)\s+metrics (\S+)\s+pid \d+$", text, re.M)
        gateway = next(addr for name, addr, _ in endpoints if name == "gateway")
        model = re.search(r"^kvrelay up: model (\S+) ", text, re.M).group(1)
        print(f"cluster: {', '.join(f'{n} metrics {m}' for n, _, m in endpoints)}", flush=True)

        # --- 4. Prometheus with the shipped job, the cluster's targets. ---
        config = load_yaml("prometheus.yml")
        config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        config["rule_files"] = [os.path.join(HERE, f) for f in config["rule_files"]]
        job = config["scrape_configs"][0]
        by_component = {}
        for name, _, metrics in endpoints:
            by_component.setdefault(re.sub(r"-\d+$", "", name), []).append(metrics)
        for sc in job["static_configs"]:
            sc["targets"] = by_component.pop(sc["labels"]["component"])
        if by_component:
            fail.add(f"prometheus.yml has no static_config for {sorted(by_component)}")
        config_path = os.path.join(tmp, "prometheus.yml")
        with open(config_path, "w", encoding="utf-8") as f:
            yaml.safe_dump(config, f)
        r = subprocess.run([PROMTOOL, "check", "config", config_path], capture_output=True,
                           text=True, timeout=30)
        print(f"promtool check config: exit {r.returncode}", flush=True)
        if r.returncode != 0:
            fail.add(f"promtool check config:\n{r.stdout}{r.stderr}")
        prom_port = free_port()
        prom_url = f"http://127.0.0.1:{prom_port}"
        logs["prometheus"] = open(os.path.join(tmp, "prometheus.log"), "w+", encoding="utf-8")
        prom = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config_path}",
             f"--storage.tsdb.path={os.path.join(tmp, 'tsdb')}",
             f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
            stdout=logs["prometheus"], stderr=subprocess.STDOUT)
        wait_for("Prometheus to be ready", lambda: "Ready" in http_get(f"{prom_url}/-/ready"), 30)

        # --- 5. Traffic: one request, then 40 more on the same prefix. The second prefill
        # worker is idle, so the gateway gives it a request whose prefix the first holds: it
        # decides to pull or recompute (the link-rate families), then pushes. ---
        def bench(n, concurrency):
            cmd = [args.kvrelay, "bench-serve", "--insecure", "--gateway", gateway,
                   "--model", model, "--num-requests", str(n), "--max-requests", str(n),
                   "--concurrency", str(concurrency), "--input-tokens", "128",
                   "--output-tokens", "8", "--shared-prefix-ratio", "0.5",
                   "--prefix-groups", "1", "--seed", "3", "--timeout", "20s",
                   "--max-duration", "30s", "--quiet", "--json", "-"]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=45)
            if r.returncode != 0:
                raise RuntimeError(f"bench-serve exited {r.returncode}: {r.stderr[-2000:]}")
            run = json.loads(r.stdout)["runs"][0]
            summary = run["summary"]
            if summary["failed"]:
                fail.add(f"bench-serve: {summary['failed']} of {n} requests failed: "
                         f"{summary['errors']}")
            return n - summary["failed"] - summary["cut"] - run["not_sent"]
        sent = 0
        for n, concurrency in ((1, 1), (40, 4)):
            sent += bench(n, concurrency)
        print(f"traffic: {sent} requests served through {gateway}", flush=True)

        # Every target up, then a scrape after the last request and two rule evaluations.
        def scraped_all():
            res = query(prom_url, f'sum(kvrelay:request_success_total) >= {sent}')["data"]
            return res["result"] and len(query(prom_url, 'up{job="kvrelay"} == 1')
                                         ["data"]["result"]) == len(endpoints)
        wait_for("Prometheus to scrape the traffic", scraped_all, 30)
        time.sleep(3)

        # --- 6. Every expression. ---
        def evaluate(what, expr, need_data):
            body = query(prom_url, expr)
            if body.get("status") != "success":
                fail.add(f"{what}: {body.get('errorType')}: {body.get('error')}\n  {expr}")
                return
            n = len(body["data"]["result"])
            print(f"{what}: {n} series", flush=True)
            if need_data and n == 0:
                fail.add(f"{what}: no data\n  {expr}")

        with open(os.path.join(HERE, "kvrelay-dashboard.json"), encoding="utf-8") as f:
            dashboard = json.load(f)
        for panel in dashboard["panels"]:
            for target in panel["targets"]:
                expr = target["expr"]
                for var, value in GRAFANA_VARS.items():
                    expr = expr.replace(var, value)
                if "$" in expr:
                    fail.add(f"panel {panel['title']!r}: unknown variable in {expr}")
                    continue
                evaluate(f"panel {panel['title']!r} {target['refId']} "
                         f"({target['legendFormat']})", expr, True)
        checks = load_yaml("checks.yml")["alerts"]
        for group in rule_groups():
            for rule in group["rules"]:
                if "record" in rule:
                    evaluate(f"rule {rule['record']}", rule["expr"], True)
                    evaluate(f"recorded {rule['record']}", rule["record"], True)
                else:
                    evaluate(f"alert {rule['alert']} expr", rule["expr"], False)
                    for selector in checks.get(rule["alert"], []):
                        evaluate(f"alert {rule['alert']} data {selector}", selector, True)
        rules = json.loads(http_get(f"{prom_url}/api/v1/rules"))["data"]["groups"]
        for g in rules:
            for r in g["rules"]:
                if r.get("health") != "ok":
                    fail.add(f"rule {r['name']}: health {r.get('health')}: {r.get('lastError')}")
                elif r["type"] == "alerting" and r["state"] == "firing":
                    fail.add(f"alert {r['name']} fires on a healthy cluster")
                elif r["type"] == "alerting" and r["state"] == "pending":
                    # Its condition holds now (e.g. a slow sanitized build's TTFT); its `for`
                    # is longer than this test.
                    print(f"alert {r['name']}: pending", flush=True)
        print(f"rules: {sum(len(g['rules']) for g in rules)} loaded by Prometheus", flush=True)
    except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError, KeyError,
            StopIteration, AttributeError, ValueError) as e:
        fail.add(f"{type(e).__name__}: {e}")
    finally:
        stop(prom, "prometheus")
        stop(up, "kvrelay up", grace_s=30)
        stop(etcd, "etcd")
        if fail.lines:
            for name, f in logs.items():
                f.flush()
                f.seek(0)
                print(f"--- {name} log (tail) ---\n{f.read()[-4000:]}")
        for f in logs.values():
            f.close()
        shutil.rmtree(tmp, ignore_errors=True)
    if fail.lines:
        print(f"{len(fail.lines)} failure(s)")
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
