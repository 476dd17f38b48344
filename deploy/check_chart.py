#!/usr/bin/env python3
"""Checks that the Helm chart and the kustomize overlays say the same thing.

Usage:
  check_chart.py [--helm PATH] [--rendered NAME=FILE ...] [--out DIR] [-v]
      For each flavor (central, central-attach, distributed, cluster), alone
      and with each component of deploy/components/ it takes (builtin-sidecars
      and inline-ephemeral for every flavor; snapshot-metadata for the central
      flavors), render the chart with `helm template` (values:
      flavor=<flavor>, and builtinSidecars=true, the inlineEphemeral values or
      snapshotMetadata.enabled=true with the chart's CRDs for the components)
      and compare it with the overlay rendered by kustomize (--rendered
      NAME=FILE, as validate.sh passes them, NAME being the overlay or
      overlay+component; rendered here when not given). The TLS material of
      snapshot-metadata is made anew by each side: it is compared as
      consistent (the SnapshotMetadataService names the secret's CA), not
      as equal. Every object of the overlay must be
      rendered by the chart, field for field, and the chart must render
      nothing else but the example StorageClass and VolumeSnapshotClass of
      deploy/examples/, equal to those files; without values, the chart
      renders the cluster overlay (the default flavor). Also: the chart's
      version and appVersion are the crate version; `helm lint --strict`
      passes for every flavor; values.schema.json rejects bad values with a clear
      message; the optional objects (ServiceMonitor, snapshot classes)
      appear only where their API exists; non-default values reach the
      objects they are for; and the comparison itself finds a changed
      argument, field or object (a test of this test).
      With --out, the chart's renderings are kept in DIR as
      chart-<name>.yaml, for deploy/check_manifests.py (--rendered).

Exit status: 0 when every check passed, 1 otherwise, 2 on a usage error.
"""

import argparse
import copy
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import check_manifests as cm  # noqa: E402  (the shared loaders and Report)

DEPLOY = cm.DEPLOY
CHART = DEPLOY / "helm" / "example-csi"
RELEASE = "example-csi"
NAMESPACE = "example-csi"
# The oldest Kubernetes the manifests are validated for.
KUBE_VERSION = "1.35.0"
SNAPSHOT_API = "snapshot.storage.k8s.io/v1/VolumeSnapshotClass"
GROUP_SNAPSHOT_API = "groupsnapshot.storage.k8s.io/v1/VolumeGroupSnapshotClass"
MONITORING_API = "monitoring.coreos.com/v1/ServiceMonitor"
# The flavor a chart installed without values renders (README.md and
# deploy/README.md say so).
DEFAULT_FLAVOR = "cluster"

# Labels Helm charts put on their objects; the overlays do not have them.
HELM_LABELS = {"helm.sh/chart", "app.kubernetes.io/managed-by", "app.kubernetes.io/instance",
               "app.kubernetes.io/version"}
# Lists whose items Kubernetes identifies by name (or by port) and whose
# order carries no meaning: compared as maps by name (a container that a
# kustomize patch adds lands first in the list). env and volumeMounts are
# compared in order: a variable may refer to an earlier one, and a mount may
# lie inside another.
KEYED_LISTS = {"containers", "initContainers", "volumes", "ports"}
# The chart does not own the namespace (it goes into the release's).
OVERLAY_ONLY_KINDS = {"Namespace"}
# Example objects the chart renders with its default values, and the label
# it adds to them as to everything else.
EXAMPLES = {"StorageClass": "storageclass.yaml", "VolumeSnapshotClass": "volumesnapshotclass.yaml"}
PART_OF = {"app.kubernetes.io/part-of": "example-csi"}


# ---------------------------------------------------------------- tools

def find_helm(given):
    if given:
        return given
    if os.environ.get("HELM"):
        return os.environ["HELM"]
    path = shutil.which("helm")
    if path:
        return path
    try:
        gopath = subprocess.run(["go", "env", "GOPATH"], capture_output=True,
                                text=True, check=True).stdout.strip()
        cand = Path(gopath) / "bin" / "helm"
        if cand.exists():
            return str(cand)
    except (OSError, subprocess.CalledProcessError):
        pass
    return None


def values_args(values):
    """--set-json for each value: exact types, no --set string guessing."""
    out = []
    for k, v in values.items():
        out += ["--set-json", f"{k}={json.dumps(v)}"]
    return out


def helm_template(helm, values=None, api_versions=(), values_file=None, crds=False):
    """(returncode, stdout, stderr) of helm template with these values (and
    the chart's crds/ with crds)."""
    cmd = [helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE,
           "--kube-version", KUBE_VERSION] + (["--include-crds"] if crds else [])
    for a in api_versions:
        cmd += ["--api-versions", a]
    if values_file:
        cmd += ["--values", str(values_file)]
    cmd += values_args(values or {})
    out = subprocess.run(cmd, capture_output=True, text=True)
    return out.returncode, out.stdout, out.stderr


def render_notes(helm, values, api_versions=()):
    """NOTES.txt as helm install would print it. helm template does not render
    it and helm install wants a cluster, so a copy of the chart renders it
    into a ConfigMap with tpl."""
    with tempfile.TemporaryDirectory() as tmp:
        chart = Path(tmp) / CHART.name
        shutil.copytree(CHART, chart)
        (chart / "notes.txt").write_text((chart / "templates" / "NOTES.txt").read_text())
        (chart / "templates" / "notes-check.yaml").write_text(
            "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\n"
            "data:\n  notes: {{ tpl (.Files.Get \"notes.txt\") . | quote }}\n")
        cmd = [helm, "template", RELEASE, str(chart), "--namespace", NAMESPACE, "--kube-version", KUBE_VERSION,
               "--show-only", "templates/notes-check.yaml"] + values_args(values)
        for a in api_versions:
            cmd += ["--api-versions", a]
        out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"rendering NOTES.txt failed: {out.stderr.strip()}")
    return yaml.safe_load(out.stdout)["data"]["notes"]


def render_chart(helm, values=None, api_versions=(), values_file=None, crds=False):
    rc, out, err = helm_template(helm, values, api_versions, values_file, crds)
    if rc != 0:
        raise RuntimeError(f"helm template {values or ''} failed: {err.strip()}")
    return out, [d for d in yaml.safe_load_all(out) if d]


# ---------------------------------------------------------------- comparison

def key(d):
    m = d.get("metadata") or {}
    return (d.get("kind"), m.get("namespace"), m.get("name"))


def show(k):
    kind, ns, name = k
    return f"{kind}/{ns + '/' if ns else ''}{name}"


def list_key(item):
    """What names an item of a keyed list: its name, or a port (a container's
    or a NetworkPolicy's) by number and protocol."""
    if "name" in item:
        return item["name"]
    return f"{item.get('containerPort', item.get('port'))}/{item.get('protocol', 'TCP')}"


def normalize(o, problems, path="", parent=None):
    """A copy of o with Helm's labels dropped and the keyed lists as maps by name."""
    if isinstance(o, dict):
        out = {}
        for k, v in o.items():
            if k == "labels" and parent == "metadata" and isinstance(v, dict):
                v = {lk: lv for lk, lv in v.items() if lk not in HELM_LABELS}
            out[k] = normalize(v, problems, f"{path}.{k}" if path else k, k)
        return out
    if isinstance(o, list):
        if parent in KEYED_LISTS and all(isinstance(i, dict) for i in o):
            byname = {}
            for i in o:
                n = list_key(i)
                if n in byname:
                    problems.append(f"{path}: {n} appears twice")
                byname[n] = normalize(i, problems, f"{path}[{n}]", None)
            return byname
        return [normalize(i, problems, f"{path}[{n}]", None) for n, i in enumerate(o)]
    return o


def differences(a, b, path=""):
    """The paths where a (the chart) and b (the expected) differ, with both values."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in list(b) + [k for k in a if k not in b]:
            p = f"{path}.{k}" if path else str(k)
            if k not in a:
                out.append(f"{p}: missing in the chart (expected {short(b[k])})")
            elif k not in b:
                out.append(f"{p}: only in the chart ({short(a[k])})")
            else:
                out += differences(a[k], b[k], p)
        return out
    if isinstance(a, list) and isinstance(b, list):
        out = []
        for i in range(max(len(a), len(b))):
            p = f"{path}[{i}]"
            if i >= len(a):
                out.append(f"{p}: missing in the chart (expected {short(b[i])})")
            elif i >= len(b):
                out.append(f"{p}: only in the chart ({short(a[i])})")
            else:
                out += differences(a[i], b[i], p)
        return out
    if a != b or type(a) is not type(b):
        return [f"{path}: chart {short(a)} != expected {short(b)}"]
    return []


def short(v):
    s = yaml.safe_dump(v, default_flow_style=True, width=1000).strip()
    if s.endswith("\n..."):
        s = s[:-4]
    return s if len(s) <= 100 else s[:97] + "..."


def expected_objects(overlay_docs, examples):
    """What the chart must render: the overlay's objects (not its Namespace) and the examples."""
    exp = {}
    for d in overlay_docs:
        if d["kind"] not in OVERLAY_ONLY_KINDS:
            exp[key(d)] = d
    for d in examples:
        d = copy.deepcopy(d)
        d.setdefault("metadata", {}).setdefault("labels", {}).update(PART_OF)
        exp[key(d)] = d
    return exp


# The TLS material of snapshot-metadata, made anew by each rendering:
# (kind, name, path to the value).
TLS_SECRET = "example-csi-snapshot-metadata-tls"
TLS_FIELDS = [("Secret", TLS_SECRET, ("data", "ca.crt")), ("Secret", TLS_SECRET, ("data", "tls.crt")),
              ("Secret", TLS_SECRET, ("data", "tls.key")),
              ("SnapshotMetadataService", cm.DRIVER_NAME, ("spec", "caCert"))]


def without_tls(docs):
    """The documents with the TLS material replaced by a mark, and the
    problems of that material: each field there, and the CA the
    SnapshotMetadataService gives clients the one of the secret."""
    out, problems, found = [], [], {}
    for d in docs:
        d = copy.deepcopy(d)
        for kind, name, path in TLS_FIELDS:
            if d.get("kind") == kind and d["metadata"].get("name") == name:
                parent = d
                for p in path[:-1]:
                    parent = parent.get(p) or {}
                value = parent.get(path[-1])
                found[(kind, path)] = "".join(str(value or "").split())
                if not found[(kind, path)]:
                    problems.append(f"{kind}/{name}: no {'.'.join(path)}")
                parent[path[-1]] = "<made by each rendering>"
        out.append(d)
    if found and found.get(("Secret", ("data", "ca.crt"))) != found.get(("SnapshotMetadataService", ("spec", "caCert"))):
        problems.append(f"SnapshotMetadataService/{cm.DRIVER_NAME}: spec.caCert is not the CA of Secret {TLS_SECRET}")
    return out, problems


def compare(chart_docs, expected):
    """Every difference between the chart's objects and the expected ones, one a line."""
    chart_docs, problems = without_tls(chart_docs)
    expected_docs, expected_problems = without_tls(expected.values())
    expected = {key(d): d for d in expected_docs}
    problems += [f"(overlay) {p}" for p in expected_problems]
    chart = {}
    for d in chart_docs:
        if key(d) in chart:
            problems.append(f"{show(key(d))}: rendered twice by the chart")
        chart[key(d)] = d
    for k in expected:
        if k not in chart:
            problems.append(f"{show(k)}: not rendered by the chart")
    for k in chart:
        if k not in expected:
            problems.append(f"{show(k)}: rendered by the chart only")
    for k in expected:
        if k in chart:
            a = normalize(chart[k], problems, show(k))
            b = normalize(expected[k], problems, show(k))
            problems += [f"{show(k)}: {d}" for d in differences(a, b)]
    return problems


# ---------------------------------------------------------------- checks

def check_versions(r, crate=None):
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    crate = crate or cm.crate_version()
    ok = r.check(chart.get("version") == crate,
                 f"Chart.yaml version {chart.get('version')} is the crate version {crate} (Cargo.toml)")
    return r.check(str(chart.get("appVersion")) == crate,
                   f"Chart.yaml appVersion {chart.get('appVersion')} is the crate version {crate}") and ok


# The chart's values that stand for each component of deploy/components/.
COMPONENT_VALUES = {
    "builtin-sidecars": {"builtinSidecars": True},
    "inline-ephemeral": {"inlineEphemeral": {"pools": ["default"], "maxSize": "1Gi"}},
    "snapshot-metadata": {"snapshotMetadata": {"enabled": True}},
}


def check_lint(helm, r):
    for flavor in cm.OVERLAYS:
        for builtin in (False, True):
            cmd = [helm, "lint", "--strict", str(CHART), "--namespace", NAMESPACE,
                   "--kube-version", KUBE_VERSION] + values_args({"flavor": flavor, "builtinSidecars": builtin})
            out = subprocess.run(cmd, capture_output=True, text=True)
            r.check(out.returncode == 0,
                    f"helm lint --strict (flavor={flavor}, builtinSidecars={str(builtin).lower()})",
                    (out.stdout + out.stderr).strip().replace("\n", " | "))


def check_drift(helm, overlays, examples, r, out_dir):
    """The chart against each overlay, alone and with each component."""
    renderings = {}
    for flavor in cm.OVERLAYS:
        for comp in [None] + [c for c in cm.COMPONENTS if flavor in cm.COMPONENT_OVERLAYS[c]]:
            name = f"{flavor}+{comp}" if comp else flavor
            values = {"flavor": flavor, **COMPONENT_VALUES.get(comp, {})}
            text, docs = render_chart(helm, values, api_versions=[SNAPSHOT_API],
                                      crds=comp == "snapshot-metadata")
            renderings[name] = docs
            if out_dir:
                (Path(out_dir) / f"chart-{name}.yaml").write_text(text)
            problems = compare(docs, expected_objects(overlays[name], examples))
            for p in problems:
                r.fail(f"chart with {values} != overlay {name} + examples: {p}")
            r.check(not problems, f"chart with {values} renders overlay {name} and the example classes, "
                    f"{len(docs)} objects, field for field")
    _, docs = render_chart(helm, api_versions=[SNAPSHOT_API])
    problems = compare(docs, expected_objects(overlays[DEFAULT_FLAVOR], examples))
    r.check(not problems, f"the chart without values renders overlay {DEFAULT_FLAVOR}, the default flavor",
            "; ".join(problems[:5]))
    return renderings


def check_self_test(renderings, r):
    """The comparison finds a changed argument, a changed field, a lost object
    in a copy of a rendering (compared with the rendering itself, so that
    this tests the comparison alone, whatever the chart renders)."""
    docs = renderings["central"]
    exp = {key(d): copy.deepcopy(d) for d in docs}
    r.check(not compare(docs, exp), "self-test: an unchanged copy compares equal")

    def mutated(change):
        m = copy.deepcopy(docs)
        change(m)
        return compare(m, exp)

    def find(m, kind, name):
        return next(d for d in m if d["kind"] == kind and d["metadata"]["name"] == name)

    def container(m, name):
        spec = find(m, "Deployment", "example-csi-controller")["spec"]["template"]["spec"]
        return next(c for c in spec["containers"] if c["name"] == name)

    def arg(m):
        c = container(m, "csi-provisioner")
        c["args"][2] += "0"
    found = mutated(arg)
    r.check(len(found) == 1 and "containers.csi-provisioner.args[2]" in found[0] and "0 != " in found[0],
            "self-test: one changed argument is reported where it is", "; ".join(found) or "not found")

    def verb(m):
        find(m, "ClusterRole", "example-csi-controller")["rules"][0]["verbs"].append("deletecollection")
    found = mutated(verb)
    r.check(len(found) == 1 and "rules[0].verbs" in found[0],
            "self-test: a verb added to a rule is reported", "; ".join(found) or "not found")

    def mount(m):
        container(m, "csi-driver")["volumeMounts"][1]["mountPropagation"] = "Bidirectional"
    found = mutated(mount)
    r.check(len(found) == 1 and "volumeMounts[1].mountPropagation" in found[0],
            "self-test: a changed mount propagation is reported", "; ".join(found) or "not found")

    def lost(m):
        m.remove(find(m, "RoleBinding", "example-csi-controller-leases"))
    found = mutated(lost)
    r.check(found == ["RoleBinding/example-csi/example-csi-controller-leases: not rendered by the chart"],
            "self-test: an object the chart lost is reported", "; ".join(found) or "not found")

    def extra_container(m):
        spec = find(m, "DaemonSet", "example-csi-node")["spec"]["template"]["spec"]
        spec["containers"].append(dict(spec["containers"][-1], name="extra"))
    found = mutated(extra_container)
    r.check(len(found) == 1 and "containers.extra: only in the chart" in found[0],
            "self-test: an added container is reported", "; ".join(found) or "not found")

    def reordered(m):
        spec = find(m, "Deployment", "example-csi-controller")["spec"]["template"]["spec"]
        spec["containers"].reverse()
        spec["volumes"].reverse()
    r.check(not mutated(reordered), "self-test: the order of containers and volumes is not a difference")

    # NetworkPolicy ports have no names: they are keyed by port and protocol.
    cluster = copy.deepcopy(renderings["cluster"])
    find(cluster, "NetworkPolicy", "example-csi-agent")["spec"]["ingress"][0]["ports"][0]["port"] = 9821
    found = compare(cluster, {key(d): d for d in renderings["cluster"]})
    r.check(any("9820/TCP: missing in the chart" in f for f in found)
            and any("9821/TCP: only in the chart" in f for f in found),
            "self-test: a changed NetworkPolicy port is reported", "; ".join(found) or "not found")

    def env_order(m):
        container(m, "csi-driver")["env"].reverse()
    found = mutated(env_order)
    r.check(found and all("containers.csi-driver.env[" in f for f in found),
            "self-test: the order of env is a difference", "; ".join(found) or "not found")

    q = cm.QuietReport()
    check_versions(q, crate="9.9.9")
    r.check(len(q.failed) == 2, "self-test: a chart version other than the crate's fails the version check",
            "; ".join(q.failed))


# Values that are not the defaults, and where each must show.
CUSTOM_VALUES = {
    "pools": [{"name": "fast", "path": "/mnt/nvme/example-csi"}, {"name": "default", "path": "/srv/pool"}],
    "dataDir": "/srv/example-csi",
    "socketGroup": 2000,
    "driver": {"logLevel": "debug", "logFormat": "text", "mutableParameters": ["directIO"],
               "maxVolumesPerNode": 16, "defaultFsType": "xfs", "expediteFreeze": False,
               "image": {"repository": "example-csi/csi-driver", "tag": "", "pullPolicy": "Always"}},
    "metrics": {"port": 9911},
    "sidecars": {"logLevel": 5},
    "imagePullSecrets": [{"name": "regcred"}],
    "node": {"nodeSelector": {"example-csi/storage": "yes"},
             "resources": {"requests": {"cpu": "20m", "memory": "64Mi"},
                           "limits": {"cpu": "2", "memory": "1Gi"}}},
    "storageClasses": [{"name": "fast", "pool": "fast", "kind": "dir", "isDefaultClass": True,
                        "reclaimPolicy": "Retain", "allowVolumeExpansion": False,
                        "mountOptions": ["noatime"]}],
}


ROUTER_VALUES = {"replicas": 2, "resources": {"requests": {"cpu": "20m", "memory": "24Mi"},
                                              "limits": {"cpu": "500m", "memory": "96Mi"}}}


def custom_values_file(tmp, flavor, builtin):
    values = copy.deepcopy(CUSTOM_VALUES)
    values["flavor"] = flavor
    values["builtinSidecars"] = builtin
    if flavor != "distributed":
        values["controller"] = {"priorityClassName": "",
                                "resources": {"requests": {"cpu": "10m", "memory": "32Mi"},
                                              "limits": {"cpu": "1", "memory": "256Mi"}}}
    if flavor == "cluster":
        values["router"] = ROUTER_VALUES
    path = Path(tmp) / f"custom-{flavor}-{builtin}.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def check_custom(helm, r, out_dir):
    """Non-default values reach the objects they are for."""
    renderings = {}
    with tempfile.TemporaryDirectory() as tmp:
        for flavor in cm.OVERLAYS:
            for builtin in (False, True):
                name = f"custom-{flavor}" + ("+builtin-sidecars" if builtin else "")
                try:
                    text, docs = render_chart(helm, values_file=custom_values_file(tmp, flavor, builtin))
                except RuntimeError as e:
                    r.fail(f"{name}: {e}")
                    continue
                renderings[name] = docs
                if out_dir:
                    (Path(out_dir) / f"chart-{name}.yaml").write_text(text)
                check_custom_rendering(name, flavor, docs, r)
    return renderings


def check_custom_rendering(name, flavor, docs, r):
    for d, spec in cm.pod_workloads(docs):
        w = f"{name}: {cm.wname(d)}"
        drv = next(c for c in spec["containers"] if cm.is_driver(c))
        flags, _ = cm.flag_values(drv)
        mode = cm.flag(drv, "--mode")
        resizer = d["metadata"]["name"] == "example-csi-resizer"
        router = mode == "router"
        serves_controller = mode in ("controller", "all")
        serves_node = mode in ("node", "all") and not resizer
        r.check(cm.flag(drv, "--log-level") == "debug" and cm.flag(drv, "--log-format") == "text",
                f"{w}: the driver logs at debug, as text")
        r.check(drv["imagePullPolicy"] == "Always", f"{w}: the driver's pull policy is Always")
        r.check(spec.get("imagePullSecrets") == [{"name": "regcred"}], f"{w}: pulls with the secret regcred")
        r.check((flags.get("--mutable-parameters") == ["directIO"]) == (serves_controller or router),
                f"{w}: --mutable-parameters=directIO exactly where the driver serves the controller "
                f"or routes it ({mode})", str(flags.get("--mutable-parameters")))
        r.check((flags.get("--max-volumes-per-node") == ["16"]) == serves_node,
                f"{w}: --max-volumes-per-node=16 exactly where the driver serves the node ({mode})",
                str(flags.get("--max-volumes-per-node")))
        r.check((flags.get("--expedite-freeze") == ["false"]) == serves_controller,
                f"{w}: --expedite-freeze=false exactly where the driver serves the controller ({mode})",
                str(flags.get("--expedite-freeze")))
        for c in spec["containers"]:
            if c is not drv and c["name"] != "liveness-probe":
                r.check(cm.flag(c, "--v") == "5", f"{w}/{c['name']}: sidecar --v=5")
        r.check(cm.flag(drv, "--socket-group") == "2000", f"{w}: the driver gives its socket to socketGroup 2000",
                str(cm.flag(drv, "--socket-group")))
        for c in spec["containers"]:
            if cm.runs_as_non_root(spec, c):
                r.check(cm.run_as(spec, c)[2] == 2000, f"{w}/{c['name']}: runs in socketGroup 2000 (runAsGroup)",
                        str(cm.run_as(spec, c)))
        fs_group = (spec.get("securityContext") or {}).get("fsGroup")
        r.check((fs_group == 2000) == (d["metadata"]["name"] == "example-csi-controller"),
                f"{w}: fsGroup is socketGroup 2000 exactly in the controller pod", str(fs_group))
        if router:
            check_custom_router(w, d, spec, drv, r)
        if resizer or router:
            continue
        r.check(flags.get("--pool") == ["fast=/mnt/nvme/example-csi", "default=/srv/pool"]
                and cm.flag(drv, "--state-dir") == "/srv/example-csi/state"
                and cm.flag(drv, "--default-fstype") == "xfs",
                f"{w}: the driver's pools, state directory and default filesystem are the values'",
                f"{flags.get('--pool')} {cm.flag(drv, '--state-dir')}")
        mounts = [(m["name"], m["mountPath"]) for m in drv["volumeMounts"]]
        r.check(all(p in mounts for p in [("data-dir", "/srv/example-csi"), ("pool-fast", "/mnt/nvme/example-csi"),
                                          ("pool-default", "/srv/pool")]),
                f"{w}: the data directory and each pool are mounted at their host path", str(mounts))
        vols = {v["name"]: (v.get("hostPath") or {}).get("path") for v in spec["volumes"]}
        r.check(vols.get("pool-fast") == "/mnt/nvme/example-csi" and vols.get("pool-default") == "/srv/pool"
                and vols.get("data-dir") == "/srv/example-csi" and "pool-ssd" not in vols,
                f"{w}: a hostPath volume for each pool of the values and no other", str(vols))
        r.check(cm.flag(drv, "--metrics-address") == "0.0.0.0:9911"
                and {"name": "metrics", "containerPort": 9911, "protocol": "TCP"} in drv["ports"],
                f"{w}: the driver serves and declares metrics on port 9911")
        if d["kind"] == "DaemonSet":
            r.check(spec.get("nodeSelector") == {"example-csi/storage": "yes"}
                    and drv["resources"]["limits"] == {"cpu": "2", "memory": "1Gi"},
                    f"{w}: the node values' nodeSelector and driver resources")
            if flavor == "cluster":
                agent = cm.flag(drv, "--agent-listen")
                r.check(agent == "0.0.0.0:9820"
                        and {"name": "agent", "containerPort": 9820, "protocol": "TCP"} in drv["ports"],
                        f"{w}: the driver is the node's agent on port 9820", str(agent))
        elif flavor != "distributed":
            r.check("priorityClassName" not in spec, f"{w}: no priorityClassName when the value is empty")
    if flavor == "cluster":
        policy = next((d for d in docs if d["kind"] == "NetworkPolicy"
                       and d["metadata"]["name"] == "example-csi-agent"), None)
        ports = [p["port"] for rule in (policy or {}).get("spec", {}).get("ingress", [])
                 for p in rule.get("ports") or []]
        peers = [sel.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component")
                 for rule in (policy or {}).get("spec", {}).get("ingress", []) for sel in rule.get("from") or []]
        r.check(ports == [9820] and sorted(peers) == ["controller", "node"],
                f"{name}: the agent NetworkPolicy lets the controller and node pods in on the agent port "
                f"alone (the metrics port stays as example-csi-metrics keeps it)", f"{ports} from {peers}")
    classes = [d for d in docs if d["kind"] == "StorageClass"]
    want = {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "provisioner": cm.DRIVER_NAME,
            "parameters": {"type": "fast", "kind": "dir"}, "reclaimPolicy": "Retain",
            "allowVolumeExpansion": False, "volumeBindingMode": "WaitForFirstConsumer",
            "mountOptions": ["noatime"]}
    got = [{k: v for k, v in c.items() if k != "metadata"} for c in classes]
    r.check(got == [want] and classes[0]["metadata"]["name"] == "fast"
            and classes[0]["metadata"].get("annotations") == {"storageclass.kubernetes.io/is-default-class": "true"},
            f"{name}: the one StorageClass of the values, the default class", str(got))
    r.check(not any(d["kind"] == "VolumeSnapshotClass" for d in docs),
            f"{name}: no VolumeSnapshotClass without the snapshot API")


def check_custom_router(w, d, spec, drv, r):
    """The router's own values reach it; it holds no volumes and no host path."""
    r.check(d["spec"]["replicas"] == ROUTER_VALUES["replicas"]
            and drv["resources"] == ROUTER_VALUES["resources"],
            f"{w}: the router values' replicas and resources", f"{d['spec']['replicas']} {drv['resources']}")
    flags, _ = cm.flag_values(drv)
    r.check(not {"--pool", "--state-dir", "--nodeid", "--max-volumes-per-node",
                 "--expedite-freeze"} & set(flags),
            f"{w}: the router gets no pool, state or node flags", str(sorted(flags)))
    r.check(cm.flag(drv, "--metrics-address") == "0.0.0.0:9911"
            and {"name": "metrics", "containerPort": 9911, "protocol": "TCP"} in drv["ports"],
            f"{w}: the router serves and declares metrics on the values' port 9911")
    host = [v["name"] for v in spec["volumes"] if "hostPath" in v]
    r.check(not host, f"{w}: the router mounts no host path", str(host))


def check_optional(helm, r):
    """Objects that depend on an API of the cluster."""
    _, docs = render_chart(helm, {"metrics": {"port": 9810, "serviceMonitor": {"enabled": True}}})
    r.check(not any(d["kind"] in ("ServiceMonitor", "Service", "VolumeSnapshotClass") for d in docs),
            "without the monitoring and snapshot APIs: no ServiceMonitor, Service or VolumeSnapshotClass")
    notes = render_notes(helm, {"metrics": {"port": 9810, "serviceMonitor": {"enabled": True}}})
    r.check("no ServiceMonitor was created" in notes and "VolumeSnapshotClasses were not created" in notes,
            "NOTES.txt says what was left out for a missing API", notes)
    notes = render_notes(helm, {"metrics": {"port": 9810, "serviceMonitor": {"enabled": True}}},
                         api_versions=[SNAPSHOT_API, MONITORING_API])
    r.check("NOTE:" not in notes, "NOTES.txt says nothing was left out where the APIs exist", notes)
    r.check("the Secret example-csi-mesh " in notes and "example-csi-mesh-node" in notes,
            "NOTES.txt of the cluster flavor names the mesh Secrets", notes)
    _, docs = render_chart(helm, {"metrics": {"port": 9810, "serviceMonitor": {
        "enabled": True, "interval": "15s", "labels": {"release": "prom"}}}},
        api_versions=[MONITORING_API])
    svc = [d for d in docs if d["kind"] == "Service"]
    sm = [d for d in docs if d["kind"] == "ServiceMonitor"]
    if not r.check(len(svc) == 1 and len(sm) == 1,
                   "with monitoring.coreos.com/v1: one Service and one ServiceMonitor"):
        return
    svc, sm = svc[0], sm[0]
    sel = sm["spec"]["selector"]["matchLabels"]
    r.check(all(svc["metadata"]["labels"].get(k) == v for k, v in sel.items())
            and sm["metadata"]["labels"].get("release") == "prom"
            and sm["spec"]["endpoints"][0] == {"port": "metrics", "path": "/metrics", "interval": "15s"},
            "the ServiceMonitor selects the Service, scrapes its port metrics every 15s, carries the labels")
    served = 0
    for d, spec in cm.pod_workloads(docs):
        labels = d["spec"]["template"]["metadata"]["labels"]
        if all(labels.get(k) == v for k, v in svc["spec"]["selector"].items()):
            served += any(p.get("name") == "metrics" and p["containerPort"] == svc["spec"]["ports"][0]["port"]
                          for c in spec["containers"] for p in c.get("ports") or [])
    r.check(served >= 1, "the Service selects the node pods, whose driver declares the metrics port")
    _, docs = render_chart(helm, {"flavor": "central", "volumeGroupSnapshotClasses": [{"name": "group"}]},
                           api_versions=[SNAPSHOT_API, GROUP_SNAPSHOT_API])
    kinds = sorted(d["kind"] for d in docs if "SnapshotClass" in d["kind"])
    r.check(kinds == ["VolumeGroupSnapshotClass", "VolumeSnapshotClass"],
            "with the snapshot APIs: the VolumeSnapshotClass and the VolumeGroupSnapshotClass", str(kinds))


def check_kubelet_dir(helm, r):
    """Another kubelet root: the node's driver stages and publishes below it,
    and mounts it."""
    for flavor in ("cluster", "distributed", "central", "central-attach"):
        _, docs = render_chart(helm, {"flavor": flavor, "kubeletDir": "/srv/kubelet"})
        node = [spec for d, spec in cm.pod_workloads(docs) if d["metadata"]["name"] == "example-csi-node"]
        drv = next((c for spec in node for c in spec["containers"] if c["name"] == "csi-driver"), None)
        if not r.check(drv is not None, f"{flavor}: a node DaemonSet with the driver"):
            continue
        mounts = sorted(m["mountPath"] for m in drv["volumeMounts"] if m["mountPath"].startswith("/srv/kubelet"))
        r.check(cm.flag(drv, "--kubelet-dir") == "/srv/kubelet"
                and mounts == ["/srv/kubelet/plugins", "/srv/kubelet/pods"],
                f"{flavor}: with kubeletDir /srv/kubelet the node's driver gets --kubelet-dir=/srv/kubelet "
                f"and mounts its pods and plugins directories there",
                f"{cm.flag(drv, '--kubelet-dir')} {mounts}")


def check_digests(helm, r):
    """Images pinned by digest: each image value's digest is rendered after its tag."""
    sidecars = ["provisioner", "attacher", "snapshotter", "resizer", "nodeDriverRegistrar", "livenessProbe",
                "snapshotMetadata"]
    digest = {n: "sha256:" + hashlib.sha256(n.encode()).hexdigest() for n in sidecars + ["driver"]}
    values = {"driver": {"image": {"digest": digest["driver"]}},
              "sidecars": {n: {"image": {"digest": digest[n]}} for n in sidecars}}
    for flavor in ("cluster", "distributed", "central-attach"):
        _, docs = render_chart(helm, dict(values, flavor=flavor))
        images = sorted({c["image"] for _, spec in cm.pod_workloads(docs) for c in spec["containers"]})
        r.check(images and all(re.fullmatch(r"[^:@]+(:[0-9]+)?[^:@]*:[A-Za-z0-9_.-]+@sha256:[0-9a-f]{64}", i)
                               and i.split("@")[1] in digest.values() for i in images),
                f"{flavor}: with a digest in every image value, every container runs repository:tag@digest",
                str(images))


# Bad values, and what the error must say (all of it, case-insensitive).
REJECTED = [
    ("an unknown flavor", {"flavor": "centralized"}, ["/flavor", "distributed"]),
    ("a pool without a path", {"pools": [{"name": "ssd"}]}, ["/pools/0", "path"]),
    ("a pool with a relative path", {"pools": [{"name": "ssd", "path": "mnt/ssd"}]},
     ["/pools/0/path", "does not match pattern '^/'"]),
    ("a pool path with ..", {"pools": [{"name": "ssd", "path": "/mnt/../etc"}]},
     ['pools: ssd: the path "/mnt/../etc" must be an absolute path without']),
    ("a pool path with a comma", {"pools": [{"name": "ssd", "path": "/mnt/a,b"}]},
     ['pools: ssd: the path "/mnt/a,b" must be']),
    ("a pool name that cannot name a volume", {"pools": [{"name": "SSD_1", "path": "/mnt/ssd"}]},
     ["/pools/0/name"]),
    ("no pool", {"pools": []}, ["/pools"]),
    ("a relative dataDir", {"dataDir": "var/lib/example-csi"}, ["/dataDir", "'^/'"]),
    ("a kubeletDir with a trailing /", {"kubeletDir": "/var/lib/kubelet/"},
     ['kubeletDir "/var/lib/kubelet/" must be']),
    ("an image tag latest", {"sidecars": {"provisioner": {"image": {"tag": "latest"}}}},
     ["/sidecars/provisioner/image/tag"]),
    ("an image digest that is not sha256 of 64 hex digits",
     {"sidecars": {"provisioner": {"image": {"digest": "sha256:abc"}}}},
     ["/sidecars/provisioner/image/digest"]),
    ("an unknown value (a typo)", {"flavour": "central"}, ["flavour"]),
    ("an unknown log format", {"driver": {"logFormat": "xml"}}, ["/driver/logFormat"]),
    ("an unknown mutable parameter", {"driver": {"mutableParameters": ["iops"]}},
     ["/driver/mutableParameters/0"]),
    ("root's group as the socket's", {"socketGroup": 0}, ["/socketGroup"]),
    ("a socket group that is not a number", {"socketGroup": "storage"}, ["/socketGroup"]),
    ("a negative max volumes per node", {"driver": {"maxVolumesPerNode": -1}}, ["/driver/maxVolumesPerNode"]),
    ("expediteFreeze not a boolean", {"driver": {"expediteFreeze": "yes"}}, ["/driver/expediteFreeze"]),
    ("a metrics port a sidecar uses", {"metrics": {"port": 9898}}, ["/metrics/port"]),
    ("the node agent's port as the metrics port", {"metrics": {"port": 9820}}, ["/metrics/port"]),
    ("no router replica", {"router": {"replicas": 0}}, ["/router/replicas"]),
    ("a pool name given twice", {"pools": [{"name": "a", "path": "/a"}, {"name": "a", "path": "/b"}]},
     ['the name "a" is given twice']),
    ("a pool on the data directory", {"pools": [{"name": "a", "path": "/var/lib/example-csi"}]},
     ["the path /var/lib/example-csi is already"]),
    ("a StorageClass on an unknown pool", {"storageClasses": [{"name": "x", "pool": "nvme"}]},
     ['names pool "nvme", which is not in pools (default, ssd)']),
    ("snapshot metadata in the distributed flavor",
     {"flavor": "distributed", "snapshotMetadata": {"enabled": True}},
     ["snapshotMetadata.enabled needs a central flavor"]),
    ("a certificate valid for no day", {"snapshotMetadata": {"certificateDays": 0}},
     ["/snapshotMetadata/certificateDays"]),
]


def check_rejections(helm, r):
    for what, values, says in REJECTED:
        rc, _, err = helm_template(helm, values)
        msg = " ".join(err.split())
        r.check(rc != 0 and all(s.lower() in msg.lower() for s in says),
                f"values.schema.json or the chart rejects {what}, saying {says}",
                f"exit {rc}: {msg[:400]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--helm", help="helm binary (default: HELM, helm on PATH, or $(go env GOPATH)/bin/helm)")
    ap.add_argument("--rendered", action="append", default=[], metavar="NAME=FILE",
                    help="an overlay rendered by kustomize (NAME: overlay or overlay+component)")
    ap.add_argument("--out", metavar="DIR", help="keep the chart's renderings here")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every check, not only failures")
    args = ap.parse_args()

    helm = find_helm(args.helm)
    if helm is None:
        print("no helm found (give --helm, or run deploy/validate.sh once)", file=sys.stderr)
        return 2
    overlays = {}
    try:
        for item in args.rendered:
            n, _, f = item.partition("=")
            overlays[n] = cm.load_file(f)
        kustomize = None
        for o in cm.OVERLAYS:
            for comp in [None] + [c for c in cm.COMPONENTS if o in cm.COMPONENT_OVERLAYS[c]]:
                name = f"{o}+{comp}" if comp else o
                if name not in overlays:
                    kustomize = kustomize or cm.find_kustomize()
                    if kustomize is None:
                        print("no kustomize found (set KUSTOMIZE, or give --rendered)", file=sys.stderr)
                        return 2
                    overlays[name] = cm.render(o, kustomize, comp)
        examples = [d for kind, f in EXAMPLES.items() for d in cm.load_file(DEPLOY / "examples" / f)
                    if d["kind"] == kind]
    except (OSError, RuntimeError, yaml.YAMLError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    version = subprocess.run([helm, "version", "--short"], capture_output=True, text=True).stdout.strip()
    print(f"helm {version}; chart {CHART.relative_to(DEPLOY.parent)}")

    r = cm.Report(verbose=args.verbose)
    try:
        r.section("version", "Chart.yaml version and appVersion are the crate version of Cargo.toml")
        check_versions(r)
        r.section("helm lint --strict", "every flavor, with and without builtinSidecars")
        check_lint(helm, r)
        r.section("chart = overlays",
                  "helm template with flavor=<overlay> (and builtinSidecars=true for +builtin-sidecars, "
                  "snapshotMetadata.enabled=true and the chart's CRDs for +snapshot-metadata) "
                  "renders every object of `kustomize build` of the overlay but its Namespace, and the "
                  "example StorageClass and VolumeSnapshotClass, field for field",
                  "ignored: Helm's own labels; the order of containers, volumes and ports")
        renderings = check_drift(helm, overlays, examples, r, args.out)
        r.section("self-test of the comparison",
                  "a changed argument, rule, mount or object in a copy of a rendering is reported")
        check_self_test(renderings, r)
        r.section("values", "non-default values reach the objects they are for")
        check_custom(helm, r, args.out)
        r.section("optional objects", "ServiceMonitor and snapshot classes only where their API exists")
        check_optional(helm, r)
        r.section("kubeletDir", "another kubelet root reaches the node driver's flag and mounts")
        check_kubelet_dir(helm, r)
        r.section("image digests", "an image value's digest is rendered as repository:tag@digest")
        check_digests(helm, r)
        r.section("values.schema.json and the chart's own checks reject bad values, saying where")
        check_rejections(helm, r)
    except RuntimeError as e:
        r.fail(str(e))
    return r.summary("check_chart")


if __name__ == "__main__":
    sys.exit(main())
