#!/usr/bin/env python3
"""Checks the Helm chart's options: what its values do, and what they refuse.

The chart deploy/helm/example-csi is the source of the manifests; the
kustomize tree is written from it by deploy/generate.py, which also checks
that the tree builds what the chart renders. This checks the rest.

Usage:
  check_values.py [--helm PATH] [--out DIR] [-v]
      The chart's version and appVersion are the crate version; `helm lint
      --strict` passes for every flavor; without values the chart renders
      the cluster flavor (the default) and the example StorageClass and
      VolumeSnapshotClass of deploy/examples/, equal to those files;
      values.schema.json and the chart's own checks reject bad values with a
      message that names them; the optional objects (ServiceMonitor,
      snapshot classes) appear only where their API exists; non-default
      values reach the objects they are for (pools, data directory, socket
      group, logging, mutable parameters, volume limit, metrics port,
      scheduling, classes, another kubelet root, image digests).
      With --out, the renderings with non-default values are kept in DIR as
      chart-custom-<flavor>[+builtin-sidecars].yaml, for
      deploy/check_manifests.py (--rendered).

Exit status: 0 when every check passed, 1 otherwise, 2 on a usage error.
"""

import argparse
import copy
import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import check_manifests as cm  # noqa: E402  (the shared loaders and Report)
import generate as gen  # noqa: E402  (helm template, as the kustomize tree is made)
from generate import (CHART, KUBE_VERSION, NAMESPACE, RELEASE,  # noqa: E402
                      helm_template, render_chart, values_args)

DEPLOY = cm.DEPLOY
SNAPSHOT_API = "snapshot.storage.k8s.io/v1/VolumeSnapshotClass"
GROUP_SNAPSHOT_API = "groupsnapshot.storage.k8s.io/v1/VolumeGroupSnapshotClass"
MONITORING_API = "monitoring.coreos.com/v1/ServiceMonitor"
# The flavor a chart installed without values renders (README.md and
# deploy/README.md say so).
DEFAULT_FLAVOR = "cluster"

# Example objects the chart renders with its default values, and the label
# it adds to them as to everything else.
EXAMPLES = {"StorageClass": "storageclass.yaml", "VolumeSnapshotClass": "volumesnapshotclass.yaml"}
PART_OF = {"app.kubernetes.io/part-of": "example-csi"}


# ---------------------------------------------------------------- tools

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


# ---------------------------------------------------------------- checks

def check_versions(r, crate=None):
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    crate = crate or cm.crate_version()
    ok = r.check(chart.get("version") == crate,
                 f"Chart.yaml version {chart.get('version')} is the crate version {crate} (Cargo.toml)")
    return r.check(str(chart.get("appVersion")) == crate,
                   f"Chart.yaml appVersion {chart.get('appVersion')} is the crate version {crate}") and ok


def check_versions_self_test(r):
    q = cm.QuietReport()
    check_versions(q, crate="9.9.9")
    r.check(len(q.failed) == 2, "self-test: a chart version other than the crate's fails the version check",
            "; ".join(q.failed))


def check_lint(helm, r):
    for flavor in cm.OVERLAYS:
        for builtin in (False, True):
            cmd = [helm, "lint", "--strict", str(CHART), "--namespace", NAMESPACE,
                   "--kube-version", KUBE_VERSION] + values_args({"flavor": flavor, "builtinSidecars": builtin})
            out = subprocess.run(cmd, capture_output=True, text=True)
            r.check(out.returncode == 0,
                    f"helm lint --strict (flavor={flavor}, builtinSidecars={str(builtin).lower()})",
                    (out.stdout + out.stderr).strip().replace("\n", " | "))


def check_defaults(helm, r):
    """Without values: the default flavor, and the example classes of
    deploy/examples/ (with the label the chart puts on everything)."""
    _, docs = render_chart(helm, api_versions=[SNAPSHOT_API])
    _, flavor = render_chart(helm, {"flavor": DEFAULT_FLAVOR}, api_versions=[SNAPSHOT_API])
    r.check(docs == flavor, f"the chart without values renders the flavor {DEFAULT_FLAVOR}, the default")
    for kind, fname in EXAMPLES.items():
        want = [copy.deepcopy(d) for d in cm.load_file(DEPLOY / "examples" / fname) if d["kind"] == kind]
        for d in want:
            d.setdefault("metadata", {}).setdefault("labels", {}).update(PART_OF)
        got = [gen.without_helm_labels(d) for d in docs if d["kind"] == kind]
        r.check(got == want, f"the chart's {kind} is the one of deploy/examples/{fname}, field for field",
                f"chart {got} != {want}")


# Values that are not the defaults, and where each must show.
CUSTOM_VALUES = {
    "pools": [{"name": "fast", "path": "/mnt/nvme/example-csi"}, {"name": "default", "path": "/srv/pool"}],
    "dataDir": "/srv/example-csi",
    "socketGroup": 2000,
    "driver": {"logLevel": "debug", "logFormat": "text", "mutableParameters": ["directIO"],
               "maxVolumesPerNode": 16, "defaultFsType": "xfs", "expediteFreeze": False,
               "image": {"repository": "example-csi/csi-driver", "tag": "", "pullPolicy": "Always"}},
    "metrics": {"port": 9911},
    "sidecars": {"logLevel": 5, "kubeApi": {"qps": 30, "burst": 60}},
    "imagePullSecrets": [{"name": "regcred"}],
    "node": {"nodeSelector": {"example-csi/storage": "yes"},
             "resources": {"requests": {"cpu": "20m", "memory": "64Mi"},
                           "limits": {"cpu": "2", "memory": "1Gi"}}},
    "storageClasses": [{"name": "fast", "pool": "fast", "kind": "dir", "isDefaultClass": True,
                        "reclaimPolicy": "Retain", "allowVolumeExpansion": False,
                        "mountOptions": ["noatime"]}],
}


# The sidecars that call the API server at a rate of their own.
API_SIDECARS = ("csi-provisioner", "csi-snapshotter", "csi-resizer", "csi-attacher")


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
            # The controller's sidecars that write to the API server go at the
            # values' rate; those of the node DaemonSet at their own default.
            if c["name"] in API_SIDECARS:
                rate = (cm.flag(c, "--kube-api-qps"), cm.flag(c, "--kube-api-burst"))
                want = (None, None) if d["kind"] == "DaemonSet" else ("30", "60")
                r.check(rate == want, f"{w}/{c['name']}: API rate {want}", str(rate))
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
    ap.add_argument("--out", metavar="DIR", help="keep the renderings with non-default values here")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every check, not only failures")
    args = ap.parse_args()

    helm = gen.find_tool(args.helm, "HELM", "helm")
    if helm is None:
        print("no helm found (give --helm, or run deploy/validate.sh once)", file=sys.stderr)
        return 2
    version = subprocess.run([helm, "version", "--short"], capture_output=True, text=True).stdout.strip()
    print(f"helm {version}; chart {CHART.relative_to(DEPLOY.parent)}")

    r = cm.Report(verbose=args.verbose)
    try:
        r.section("version", "Chart.yaml version and appVersion are the crate version of Cargo.toml")
        check_versions(r)
        check_versions_self_test(r)
        r.section("helm lint --strict", "every flavor, with and without builtinSidecars")
        check_lint(helm, r)
        r.section("defaults", f"without values: the flavor {DEFAULT_FLAVOR} and the example StorageClass "
                  "and VolumeSnapshotClass of deploy/examples/")
        check_defaults(helm, r)
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
    return r.summary("check_values")


if __name__ == "__main__":
    sys.exit(main())
