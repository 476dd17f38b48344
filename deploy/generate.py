#!/usr/bin/env python3
"""Writes the kustomize tree of deploy/ from the Helm chart.

The chart deploy/helm/example-csi is the one source of the manifests. This
script renders it with `helm template` and writes what kustomize users
apply:
  base/               the objects every flavor renders alike (the Namespace,
                      the metrics NetworkPolicy)
  overlays/<flavor>/  the base and the rest of the rendering with
                      flavor=<flavor>, one file per template of the chart
  components/<name>/  what an option of the chart adds to a flavor: its new
                      objects as resources, its changes to the flavor's
                      objects as strategic merge patches computed from the
                      renderings with and without it. A patch serves every
                      flavor whose object it changes alike, targeted by
                      kind and name, and by a label where flavors differ.
The renderings leave out Helm's own labels, the StorageClasses and snapshot
classes (deploy/examples/ has them), and the TLS material of
snapshot-metadata, which its make-certs.sh makes for kustomize users.
Every file written says that it is generated, and from what.

Usage:
  generate.py [--helm PATH] [--kustomize PATH] [--check] [--renders DIR] [-v]
      Writes the tree into deploy/ (removing generated files that are no
      longer made), then builds each overlay, alone and with each component
      it takes, with kustomize, and requires the result to be the chart's
      rendering with the same values: the same objects, field for field,
      lists in the same order but containers, volumes and ports, which
      Kubernetes names and a kustomize patch puts first (the TLS material
      of snapshot-metadata is required to agree with itself, as each side
      makes its own).
      --check: write into a temporary directory instead, and fail naming
      each file of deploy/ that differs from what the chart makes now.
      --renders DIR: keep the chart's renderings as DIR/<name>.yaml (name:
      the flavor or flavor+component), for check_manifests.py.

Exit status: 0 when the tree is written (or current) and builds what the
chart renders, 1 otherwise, 2 on a usage error.
"""

import argparse
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parent
CHART = DEPLOY / "helm" / "example-csi"
COMMAND = "python3 deploy/generate.py"
RELEASE = "example-csi"
NAMESPACE = "example-csi"
# The oldest Kubernetes the manifests are for.
KUBE_VERSION = "1.35.0"
FLAVORS = ["central", "central-attach", "distributed", "cluster"]
# The chart's values that stand for each component, and the flavors it is for.
COMPONENT_VALUES = {
    "builtin-sidecars": {"builtinSidecars": True},
    "inline-ephemeral": {"inlineEphemeral": {"pools": ["default"], "maxSize": "1Gi"}},
    "snapshot-metadata": {"snapshotMetadata": {"enabled": True}},
}
COMPONENT_FLAVORS = {"builtin-sidecars": FLAVORS, "inline-ephemeral": FLAVORS,
                     # one service address cannot reach every node's snapshots
                     "snapshot-metadata": ["central", "central-attach"]}
# Components that need the chart's crds/ rendered.
WITH_CRDS = {"snapshot-metadata"}
# The values every rendering for kustomize has: the namespace in it, no
# example classes.
TREE_VALUES = {"createNamespace": True, "storageClasses": [], "volumeSnapshotClasses": [],
               "volumeGroupSnapshotClasses": []}
# Labels Helm puts on every object; the kustomize tree has none of them.
HELM_LABELS = {"helm.sh/chart", "app.kubernetes.io/managed-by", "app.kubernetes.io/instance",
               "app.kubernetes.io/version"}
# Files of the tree written by hand, never by this script.
HAND_WRITTEN = {"components/snapshot-metadata/make-certs.sh", "components/snapshot-metadata/.gitignore"}
# Folders of the tree this script writes, and what it leaves alone in them.
TREE = ["base", "overlays", "components"]
NOT_IN_TREE = ("components/snapshot-metadata/tls/",)

# The TLS material of snapshot-metadata: the chart makes it at install, the
# kustomize tree takes it from make-certs.sh (a Secret generated from its
# files, and its patch tls/ca-cert.yaml naming the CA).
TLS_SECRET = "example-csi-snapshot-metadata-tls"
TLS_FIELDS = [("Secret", TLS_SECRET, ("data", "ca.crt")), ("Secret", TLS_SECRET, ("data", "tls.crt")),
              ("Secret", TLS_SECRET, ("data", "tls.key")),
              ("SnapshotMetadataService", "example.csi.k8s.io", ("spec", "caCert"))]
TLS_KUSTOMIZATION = {
    "secretGenerator": [{
        "name": TLS_SECRET, "namespace": NAMESPACE, "type": "kubernetes.io/tls",
        "files": ["tls/tls.crt", "tls/tls.key", "tls/ca.crt"],
        "options": {"disableNameSuffixHash": True, "labels": {"app.kubernetes.io/part-of": "example-csi"}}}],
    "patches": [{"path": "tls/ca-cert.yaml"}],
}

# What each generated kustomization says of itself.
ABOUT = {
    "base": "The objects every flavor of example-csi has alike; each overlay builds on it.",
    "central": """central: one controller Deployment (external-provisioner,
external-snapshotter, external-resizer, livenessprobe and the driver in
--mode controller) and a node DaemonSet (node-driver-registrar,
livenessprobe and the driver in --mode node). Storage is local to the
node, so this flavor is right for a single-node cluster, where the
controller and the node plugin share the node's pool directory.""",
    "central-attach": """central-attach: the central flavor with ControllerPublishVolume on.
The driver runs with --enable-attach (PUBLISH_UNPUBLISH_VOLUME: it
records which node a volume is published to), external-attacher joins
the controller pod, and the CSIDriver says attachRequired: true so that
Kubernetes creates VolumeAttachment objects.""",
    "distributed": """distributed: one DaemonSet whose pods run the driver in --mode all next
to external-provisioner and external-snapshotter in node-deployment mode,
node-driver-registrar and livenessprobe; storage capacity tracking on.
external-resizer has no per-node mode: it runs once, in a small
Deployment, and the driver is started with
--disable-controller-expansion everywhere, so the resizer only records
the new size and kubelet's NodeExpandVolume on the volume's own node
grows the image, the loop device and the filesystem.""",
    "cluster": """cluster (the default, for clusters of any size): one controller
Deployment and a node DaemonSet, as in the usual CSI layout, with every
feature on every node. The controller runs the stock sidecars in their
normal mode next to the driver in --mode router, which holds no volumes:
it sends each call to the node agent that holds the data, over mutual
TLS. Each node's driver (--mode all) is that node's agent. The mesh's
certificate authority is the Secret example-csi-mesh, made by the
controller on its first start (or supplied by the operator:
deploy/README.md); node pods start once it exists.""",
    "builtin-sidecars": """builtin-sidecars: the driver registers itself with the kubelet and
answers the kubelet's liveness probe itself, instead of
node-driver-registrar and livenessprobe (the chart's builtinSidecars).
Add it to any overlay:

  components:
    - ../../components/builtin-sidecars""",
    "inline-ephemeral": """inline-ephemeral: inline ephemeral volumes (a CSI volume written into a
pod's spec, made when the pod starts and deleted with it) in the pool
"default", each at most 1 GiB, its size reserved in the pool until its pod
is gone (the chart's inlineEphemeral). Off without this component: any
pod author can write one, with no claim and no ResourceQuota in between.
Prefer generic ephemeral volumes (a volumeClaimTemplate in the pod), which
need nothing here. Add it to any overlay, and patch the pools and size
(CSI_EPHEMERAL_POOLS, CSI_EPHEMERAL_MAX_SIZE of the node's csi-driver) in
your own kustomization to taste:

  components:
    - ../../components/inline-ephemeral""",
    "snapshot-metadata": """snapshot-metadata: changed block tracking for backup applications (the
chart's snapshotMetadata). The external-snapshot-metadata sidecar runs
next to the driver in the controller Deployment and serves the driver's
SnapshotMetadata service to clients in the cluster over TLS, checking each
client's token. Add it to the central or central-attach overlay:

  components:
    - ../../components/snapshot-metadata

The TLS secret and the patch that gives clients its CA come from
./make-certs.sh (run it once before the first build; it writes tls/, which
is not in git). Not for the distributed or cluster flavor: one service
address cannot reach every node's snapshots.""",
}


class Failure(Exception):
    """The chart renders what the kustomize tree cannot express, or the
    tree does not build what the chart renders."""


# ---------------------------------------------------------------- helm

def find_tool(given, env, name):
    """The tool given, else the one the environment variable names, else
    name on PATH or in $(go env GOPATH)/bin (where validate.sh installs it)."""
    if given:
        return given
    if os.environ.get(env):
        return os.environ[env]
    path = shutil.which(name)
    if path:
        return path
    try:
        gopath = subprocess.run(["go", "env", "GOPATH"], capture_output=True,
                                text=True, check=True).stdout.strip()
        cand = Path(gopath) / "bin" / name
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


def render_chart(helm, values=None, api_versions=(), values_file=None, crds=False):
    """The chart's text and objects with these values."""
    rc, out, err = helm_template(helm, values, api_versions, values_file, crds)
    if rc != 0:
        raise RuntimeError(f"helm template {values or ''} failed: {err.strip()}")
    return out, [d for d in yaml.safe_load_all(out) if d]


def without_helm_labels(d):
    """A copy of d without the labels Helm puts on every object."""
    d = copy.deepcopy(d)
    labels = d.get("metadata", {}).get("labels")
    if labels is not None:
        for k in HELM_LABELS:
            labels.pop(k, None)
    return d


def tree_values(flavor, components=()):
    values = dict(TREE_VALUES, flavor=flavor)
    for c in components:
        values.update(COMPONENT_VALUES[c])
    return values


def render_tree(helm, flavor, components=()):
    """The chart's rendering for the kustomize tree: (text, [(source
    template, object)]) with Helm's labels dropped."""
    rc, text, err = helm_template(helm, tree_values(flavor, components),
                                  crds=bool(WITH_CRDS & set(components)))
    if rc != 0:
        raise RuntimeError(f"helm template for {'+'.join([flavor, *components])} failed: {err.strip()}")
    out, source = [], None
    for chunk in text.split("\n---\n"):
        # A file of crds/ that starts with --- leaves Helm's Source line
        # alone in the chunk before its object.
        source = next((line.split(": ", 1)[1] for line in chunk.splitlines()
                       if line.startswith("# Source: ")), source)
        d = yaml.safe_load(chunk)
        if d:
            out.append((source, without_helm_labels(d)))
            source = None
    return text, out


def key(d):
    m = d.get("metadata") or {}
    return (d.get("kind"), m.get("namespace"), m.get("name"))


def show(k):
    kind, ns, name = k
    return f"{kind}/{ns + '/' if ns else ''}{name}"


# ---------------------------------------------------------------- patches

def merge_key(field, items):
    """The key Kubernetes merges the items of a list by in a strategic merge
    patch, or None for a list replaced as a whole."""
    if not items or not all(isinstance(i, dict) for i in items):
        return None
    if field in ("containers", "initContainers", "volumes", "env", "imagePullSecrets"):
        return "name"
    if field == "volumeMounts":
        return "mountPath"
    if field == "ports" and all("containerPort" in i for i in items):
        return "containerPort"
    return None


def strategic_patch(a, b, where):
    """The strategic merge patch that makes the mapping a into b."""
    out = {}
    for k, v in b.items():
        if k not in a:
            out[k] = copy.deepcopy(v)
        elif a[k] != v:
            if isinstance(v, dict) and isinstance(a[k], dict):
                out[k] = strategic_patch(a[k], v, f"{where}.{k}")
            elif isinstance(v, list) and isinstance(a[k], list) and merge_key(k, a[k] + v):
                out[k] = list_patch(a[k], v, merge_key(k, a[k] + v), f"{where}.{k}")
            else:
                out[k] = copy.deepcopy(v)
    for k in a:
        if k not in b:
            out[k] = None
    return out


def list_patch(a, b, mk, where):
    """The items of a merged list's patch: new and changed items (with their
    key), and a deletion of each item gone."""
    before = {i[mk]: i for i in a}
    after = {i[mk]: i for i in b}
    kept = [i[mk] for i in a if i[mk] in after]
    if kept != [i[mk] for i in b if i[mk] in before]:
        raise Failure(f"{where}: the option reorders the items {kept}, which a patch cannot")
    out = []
    for i in b:
        if i[mk] not in before:
            out.append(copy.deepcopy(i))
        elif i != before[i[mk]]:
            out.append({mk: i[mk], **strategic_patch(before[i[mk]], i, f"{where}[{i[mk]}]")})
    for i in a:
        if i[mk] not in after:
            extra = {"protocol": i["protocol"]} if mk == "containerPort" and "protocol" in i else {}
            out.append({mk: i[mk], **extra, "$patch": "delete"})
    return out


def selector_for(group, others):
    """A label selector that matches every object of group and none of
    others (label maps), or None."""
    if not others:
        return ""
    labels = [set(g.items()) for g in group]
    other = [set(o.items()) for o in others]
    for k, v in sorted(set.intersection(*labels)):
        if not any((k, v) in o for o in other):
            return f"{k}={v}"
    for k, v in sorted(set.intersection(*other)):
        if not any((k, v) in g for g in labels):
            return f"{k}!={v}"
    return None


# ---------------------------------------------------------------- writing

def header(what, values):
    """The comment every generated file starts with."""
    lines = textwrap.wrap(f"Generated by deploy/generate.py from the Helm chart deploy/helm/example-csi: "
                          f"{what}, with the values {values}. Do not edit: change the chart, then run",
                          width=76, break_on_hyphens=False, break_long_words=False)
    return "".join(f"# {line}\n" for line in lines) + f"#   {COMMAND}\n"


class Dumper(yaml.SafeDumper):
    """Block style; multi-line strings as literal blocks, long ones folded
    (yamllint's lines are at most 120 characters)."""


def _str(dumper, s):
    if "\n" in s:
        return dumper.represent_scalar("tag:yaml.org,2002:str", s, style="|")
    if len(s) > 80 and " " in s:
        return dumper.represent_scalar("tag:yaml.org,2002:str", s, style=">")
    return dumper.represent_scalar("tag:yaml.org,2002:str", s)


Dumper.add_representer(str, _str)


def dump_docs(docs):
    return "".join("---\n" + yaml.dump(d, Dumper=Dumper, sort_keys=False, default_flow_style=False,
                                       width=70, allow_unicode=True) for d in docs)


def values_text(values):
    return ", ".join(f"{k}={json.dumps(v)}" for k, v in values.items())


def kustomization(kind, about, head, body):
    lines = head + "---\n" + "".join(f"# {line}".rstrip() + "\n" for line in about.splitlines())
    api = "kustomize.config.k8s.io/v1alpha1" if kind == "Component" else "kustomize.config.k8s.io/v1beta1"
    return lines + dump_docs([{"apiVersion": api, "kind": kind, **body}])[4:]


def by_source(objects):
    """{file name: [objects]} in the order of the rendering, one file per
    template of the chart."""
    files = {}
    for source, d in objects:
        name = Path(source).name if source else "objects.yaml"
        if source and "/crds/" in source:
            name = "crd-" + name
        files.setdefault(name, []).append(d)
    return files


def generate(helm):
    """{path in deploy/: text} of the whole tree, and the chart's renderings
    by name (flavor or flavor+component) for the comparison."""
    files, renders = {}, {}
    flavor_objects = {}
    for f in FLAVORS:
        text, objects = render_tree(helm, f)
        renders[f] = text
        flavor_objects[f] = objects
    # the base: objects every flavor renders alike
    first = {key(d): d for _, d in flavor_objects[FLAVORS[0]]}
    common = [k for k in first if all(any(key(d) == k and d == first[k] for _, d in flavor_objects[f])
                                       for f in FLAVORS[1:])]
    base = [(s, d) for s, d in flavor_objects[FLAVORS[0]] if key(d) in common]
    head = header("what `helm template` renders alike for every flavor", values_text(TREE_VALUES))
    base_files = by_source(base)
    for name, docs in base_files.items():
        files[f"base/{name}"] = head + dump_docs(docs)
    files["base/kustomization.yaml"] = kustomization(
        "Kustomization", ABOUT["base"], head, {"resources": list(base_files)})
    for f in FLAVORS:
        values = values_text(tree_values(f))
        head = header(f"what `helm template` renders for the flavor {f} but the base", values)
        own = by_source([(s, d) for s, d in flavor_objects[f] if key(d) not in common])
        for name, docs in own.items():
            files[f"overlays/{f}/{name}"] = head + dump_docs(docs)
        files[f"overlays/{f}/kustomization.yaml"] = kustomization(
            "Kustomization", ABOUT[f], head, {"resources": ["../../base", *own]})
    for c in COMPONENT_VALUES:
        text_files, comp_renders = component(helm, c, {f: flavor_objects[f] for f in COMPONENT_FLAVORS[c]})
        files.update(text_files)
        renders.update(comp_renders)
    return files, renders


def component(helm, c, flavor_objects):
    """The files of component c, computed from each flavor it is for."""
    head = header(f"what `helm template` renders with and without an option, for the flavors "
                  f"{', '.join(flavor_objects)}", values_text(COMPONENT_VALUES[c]))
    added = {}          # key: (source, object)
    changes = {}        # key: {flavor: patch or None}
    labels = {}         # key: {flavor: the object's labels}
    renders = {}
    for f, objects in flavor_objects.items():
        text, with_c = render_tree(helm, f, [c])
        renders[f"{f}+{c}"] = text
        before = {key(d): d for _, d in objects}
        after = {key(d): (s, d) for s, d in with_c}
        for k in before:
            if k not in after:
                raise Failure(f"{c} with {f}: {show(k)} goes, which a component cannot say")
            p = strategic_patch(before[k], after[k][1], show(k))
            changes.setdefault(k, {})[f] = p or None
            labels.setdefault(k, {})[f] = before[k]["metadata"].get("labels") or {}
        for k, (s, d) in after.items():
            if k in before:
                continue
            d = tls_blanked(d)
            if k in added and added[k][1] != d:
                raise Failure(f"{c}: {show(k)} differs between flavors, which a component cannot say")
            added[k] = (s, d)
    files = {}
    body = {}
    resources = by_source([(s, d) for s, d in added.values()
                           if not (d["kind"] == "Secret" and d["metadata"]["name"] == TLS_SECRET)])
    for name, docs in resources.items():
        files[f"components/{c}/{name}"] = head + dump_docs(docs)
    if resources:
        body["resources"] = list(resources)
    tls = any(k == ("Secret", NAMESPACE, TLS_SECRET) for k in added)
    if tls:
        body["secretGenerator"] = TLS_KUSTOMIZATION["secretGenerator"]
    patches = []
    for k, by_flavor in changes.items():
        distinct = []
        for p in by_flavor.values():
            if p is not None and p not in distinct:
                distinct.append(p)
        for n, p in enumerate(distinct):
            group = [labels[k][f] for f, q in by_flavor.items() if q == p]
            others = [labels[k][f] for f, q in by_flavor.items() if q != p]
            sel = selector_for(group, others)
            if sel is None:
                raise Failure(f"{c}: {show(k)} changes differently between flavors that no label tells apart")
            kind, _, name = k
            obj = next(d for f, objects in flavor_objects.items() for _, d in objects if key(d) == k)
            group_name, _, version = obj["apiVersion"].rpartition("/")
            fname = f"patch-{kind.lower()}-{name}" + (f"-{n + 1}" if len(distinct) > 1 else "") + ".yaml"
            doc = {"apiVersion": obj["apiVersion"], "kind": kind, "metadata": {"name": name}, **p}
            files[f"components/{c}/{fname}"] = head + dump_docs([doc])
            target = {"group": group_name, "version": version, "kind": kind, "name": name}
            if not group_name:
                del target["group"]
            if sel:
                target["labelSelector"] = sel
            patches.append({"path": fname, "target": target})
    if tls:
        patches += TLS_KUSTOMIZATION["patches"]
    if patches:
        body["patches"] = patches
    files[f"components/{c}/kustomization.yaml"] = kustomization("Component", ABOUT[c], head, body)
    return files, renders


def tls_blanked(d):
    """d without its TLS material (made anew by each rendering)."""
    d = copy.deepcopy(d)
    for kind, name, path in TLS_FIELDS:
        if d.get("kind") == kind and d["metadata"].get("name") == name:
            parent = d
            for p in path[:-1]:
                parent = parent[p]
            if kind == "Secret":
                parent.pop(path[-1], None)
            else:
                # filled in by make-certs.sh's patch tls/ca-cert.yaml
                parent[path[-1]] = ""
    return d


# ---------------------------------------------------------------- the tree

def tree_files(root):
    """The files of the generated folders under root, relative to root."""
    out = set()
    for top in TREE:
        for p in (Path(root) / top).rglob("*"):
            rel = p.relative_to(root).as_posix()
            if p.is_file() and rel not in HAND_WRITTEN and not rel.startswith(NOT_IN_TREE):
                out.add(rel)
    return out


def write_tree(files, root):
    """Writes files under root; removes the generated files no longer made."""
    for rel in tree_files(root) - set(files):
        (Path(root) / rel).unlink()
    for rel, text in files.items():
        p = Path(root) / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    for top in TREE:
        for d in sorted((Path(root) / top).rglob("*"), reverse=True):
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()


def differing(files, root):
    """The files of root that differ from files, missing or extra."""
    out = []
    for rel in sorted(set(files) | tree_files(root)):
        p = Path(root) / rel
        if rel not in files:
            out.append(f"{rel}: not made from the chart (remove it)")
        elif not p.exists():
            out.append(f"{rel}: missing")
        elif p.read_text() != files[rel]:
            out.append(f"{rel}: differs")
    return out


# ---------------------------------------------------------------- comparison

def tls_consistent(docs, where):
    """The documents with the TLS material replaced by a mark; a Failure if
    a field is empty or the SnapshotMetadataService names another CA than
    the secret's."""
    out, found = [], {}
    for d in docs:
        d = copy.deepcopy(d)
        for kind, name, path in TLS_FIELDS:
            if d.get("kind") == kind and d["metadata"].get("name") == name:
                parent = d
                for p in path[:-1]:
                    parent = parent.get(p) or {}
                found[(kind, path)] = "".join(str(parent.get(path[-1]) or "").split())
                if not found[(kind, path)]:
                    raise Failure(f"{where}: {kind}/{name} has no {'.'.join(path)}")
                parent[path[-1]] = "<made by each rendering>"
        out.append(d)
    if found and found.get(("Secret", ("data", "ca.crt"))) != \
            found.get(("SnapshotMetadataService", ("spec", "caCert"))):
        raise Failure(f"{where}: the SnapshotMetadataService's caCert is not the CA of Secret {TLS_SECRET}")
    return out


# Lists whose items Kubernetes identifies by name (or port) and whose order
# carries no meaning: compared as maps (a container a kustomize patch adds
# lands first). env and volumeMounts keep their order: a variable may refer
# to an earlier one, a mount may lie inside another.
KEYED_LISTS = {"containers", "initContainers", "volumes", "ports"}


def list_key(item):
    if "name" in item:
        return item["name"]
    return f"{item.get('containerPort', item.get('port'))}/{item.get('protocol', 'TCP')}"


def differences(a, b, path="", field=None):
    """Where a (kustomize) and b (the chart) differ."""
    if isinstance(a, list) and isinstance(b, list) and field in KEYED_LISTS \
            and all(isinstance(i, dict) for i in a + b):
        a = {list_key(i): i for i in a} if len({list_key(i) for i in a}) == len(a) else a
        b = {list_key(i): i for i in b} if len({list_key(i) for i in b}) == len(b) else b
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in list(b) + [k for k in a if k not in b]:
            p = f"{path}.{k}" if path else str(k)
            if k not in a:
                out.append(f"{p}: only in the chart")
            elif k not in b:
                out.append(f"{p}: only in the kustomize tree")
            else:
                out += differences(a[k], b[k], p, k)
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items in the kustomize tree, {len(b)} in the chart"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    if a != b or type(a) is not type(b):
        return [f"{path}: kustomize {a!r:.80} != chart {b!r:.80}"]
    return []


def compare(built, chart, where):
    """Every difference between kustomize's objects and the chart's."""
    a = {key(d): d for d in tls_consistent(built, f"{where} (kustomize)")}
    b = {key(without_helm_labels(d)): without_helm_labels(d)
         for d in tls_consistent(chart, f"{where} (chart)")}
    problems = [f"{show(k)}: only in the kustomize tree" for k in a if k not in b]
    problems += [f"{show(k)}: only in the chart" for k in b if k not in a]
    for k in b:
        if k in a:
            problems += [f"{show(k)}: {d}" for d in differences(a[k], b[k])]
    return problems


def build_and_compare(kustomize, root, renders, verbose):
    """kustomize build of every flavor and flavor+component under root
    against the chart's rendering."""
    made = subprocess.run([str(DEPLOY / "components" / "snapshot-metadata" / "make-certs.sh")],
                          capture_output=True, text=True)
    if made.returncode != 0:
        raise Failure(f"make-certs.sh failed: {made.stderr.strip()}")
    tls = Path(root) / "components" / "snapshot-metadata" / "tls"
    if Path(root) != DEPLOY:
        shutil.copytree(DEPLOY / "components" / "snapshot-metadata" / "tls", tls)
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in renders.items():
            flavor, _, comp = name.partition("+")
            target = Path(root) / "overlays" / flavor
            if comp:
                target = Path(tmp) / name
                target.mkdir()
                rel = os.path.relpath(root, target)
                (target / "kustomization.yaml").write_text(
                    "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
                    f"resources:\n  - {rel}/overlays/{flavor}\ncomponents:\n  - {rel}/components/{comp}\n")
            # kubectl has kustomize built in, as `kubectl kustomize`
            build = [kustomize, "kustomize" if Path(kustomize).name == "kubectl" else "build"]
            out = subprocess.run(build + [str(target)], capture_output=True, text=True)
            if out.returncode != 0:
                problems.append(f"kustomize build of {name} failed: {out.stderr.strip()}")
                continue
            built = [d for d in yaml.safe_load_all(out.stdout) if d]
            found = compare(built, [d for d in yaml.safe_load_all(text) if d], name)
            problems += [f"{name}: {p}" for p in found]
            if verbose or found:
                print(f"  {'ok  ' if not found else 'FAIL'}  {name}: kustomize build renders the chart's "
                      f"{len(built)} objects, field for field")
    return problems


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--helm", help="helm binary (default: HELM, helm on PATH, or $(go env GOPATH)/bin/helm)")
    ap.add_argument("--kustomize", help="kustomize binary, or kubectl (default: KUSTOMIZE, kustomize on PATH, "
                                        "or $(go env GOPATH)/bin/kustomize)")
    ap.add_argument("--check", action="store_true", help="compare deploy/ with what the chart makes; write nothing")
    ap.add_argument("--renders", metavar="DIR", help="keep the chart's renderings here")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every comparison, not only failures")
    args = ap.parse_args()
    helm = find_tool(args.helm, "HELM", "helm")
    kustomize = find_tool(args.kustomize, "KUSTOMIZE", "kustomize")
    if helm is None or kustomize is None:
        print("no helm or kustomize found (give --helm and --kustomize, or run deploy/validate.sh once)",
              file=sys.stderr)
        return 2
    try:
        files, renders = generate(helm)
        if args.renders:
            for name, text in renders.items():
                (Path(args.renders) / f"{name}.yaml").write_text(text)
        if args.check:
            with tempfile.TemporaryDirectory() as tmp:
                write_tree(files, tmp)
                stale = differing(files, DEPLOY)
                problems = build_and_compare(kustomize, tmp, renders, args.verbose)
        else:
            write_tree(files, DEPLOY)
            stale = []
            problems = build_and_compare(kustomize, DEPLOY, renders, args.verbose)
    except (Failure, RuntimeError, OSError) as e:
        print(f"generate: {e}", file=sys.stderr)
        return 1
    for p in stale:
        print(f"  FAIL  deploy/{p}")
    for p in problems:
        print(f"  FAIL  {p}")
    if stale:
        print(f"generate: the kustomize tree is not what the chart makes now: run {COMMAND}")
    if problems:
        print("generate: the kustomize tree does not build what the chart renders")
    if stale or problems:
        return 1
    print(f"generate: {len(files)} files {'current' if args.check else 'written'}; kustomize builds what the "
          f"chart renders for {len(renders)} flavors and flavor+component ({', '.join(renders)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
