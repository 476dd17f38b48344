#!/usr/bin/env python3
"""Checks of the example-csi manifests that a schema cannot express.

Usage:
  check_manifests.py [--k8s-version 1.35 --k8s-version 1.37]
                     [--rendered NAME=FILE ...] [--examples DIR]
                     [--check-binary PATH]
      Validate the renderings of the Helm chart deploy/helm/example-csi (the
      source of the manifests) and the examples: every object against the
      Kubernetes API schemas of each version (kubernetes-validate, strict)
      or, for the CRD-based kinds, against the JSON schemas in
      deploy/schemas/; the security posture; the wiring of sockets, ports,
      flags and RBAC inside each rendering.
      With --check-binary, also run `PATH --help` and require every flag
      the manifests pass to the driver to appear in it.
      Without --rendered, the chart is rendered here for each flavor, alone
      and with each component it takes, as deploy/generate.py renders it
      for the kustomize tree (helm: HELM, helm on PATH or in
      $(go env GOPATH)/bin). Without helm, the kustomize tree written from
      those renderings is built instead (KUSTOMIZE, kustomize on PATH or in
      $(go env GOPATH)/bin, or `kubectl kustomize`).

  check_manifests.py --driver-flags
      Print, one a line and once each, the name of every flag (--name) the
      manifests pass to the csi-driver container, for a test that compares
      them with the binary's --help.

Exit status: 0 when every check passed, 1 otherwise, 2 on a usage error.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import tempfile
import sys
from pathlib import Path

import yaml

import generate

DEPLOY = Path(__file__).resolve().parent
REPO = DEPLOY.parent
OVERLAYS = ["central", "central-attach", "distributed", "cluster"]
# Components an operator may add to an overlay, with the overlays each is for;
# each of those overlays is checked with each.
COMPONENTS = ["builtin-sidecars", "inline-ephemeral", "snapshot-metadata"]
COMPONENT_OVERLAYS = {"builtin-sidecars": OVERLAYS, "inline-ephemeral": OVERLAYS,
                      # one service address cannot reach every node's snapshots
                      "snapshot-metadata": ["central", "central-attach"]}
DRIVER_NAME = "example.csi.k8s.io"
DRIVER_IMAGE_REPO = "example-csi/csi-driver"
DRIVER_CONTAINER = "csi-driver"
SIDECAR_REGISTRY = "registry.k8s.io/sig-storage/"
KUBELET_DIR = "/var/lib/kubelet"
MUTABLE_PARAMETERS = {"directIO", "readAheadKiB", "compression", "transferBandwidth"}

# Schemas for the CRD-based kinds, written from the CRDs of
# external-snapshotter (see each file's description).
CRD_SCHEMAS = {
    ("snapshot.storage.k8s.io/v1", "VolumeSnapshotClass"): "volumesnapshotclass-snapshot-v1.json",
    ("snapshot.storage.k8s.io/v1", "VolumeSnapshot"): "volumesnapshot-snapshot-v1.json",
    ("groupsnapshot.storage.k8s.io/v1", "VolumeGroupSnapshotClass"): "volumegroupsnapshotclass-groupsnapshot-v1.json",
    ("groupsnapshot.storage.k8s.io/v1", "VolumeGroupSnapshot"): "volumegroupsnapshot-groupsnapshot-v1.json",
    ("cbt.storage.k8s.io/v1beta1", "SnapshotMetadataService"): "snapshotmetadataservice-cbt-v1beta1.json",
}
# Kinds knowingly not validated against any schema, with the reason.
# Empty: every kind the manifests use has a schema.
SKIPPED_KINDS = {}

WORKLOAD_KINDS = {"Deployment", "DaemonSet", "StatefulSet"}
# The rendering the self-test breaks copies of: a root driver, non-root
# sidecars and a Secret one of them reads.
SELF_TEST_RENDERING = "central+snapshot-metadata"

REGISTRAR_IMAGE = SIDECAR_REGISTRY + "csi-node-driver-registrar:"
# Who runs as root besides the privileged node driver: node-driver-registrar
# (it makes its registration socket in the kubelet's root-owned
# plugins_registry), and these driver instances, by workload and --mode, each
# without capabilities. Every other container runs as a non-root user.
ROOT_DRIVERS = {
    ("Deployment", "example-csi-controller", "controller"):
        "the central controller writes the node's root-owned pool and state directories",
}


class Report:
    def __init__(self, verbose=False):
        self.passed = 0
        self.failed = []
        self.verbose = verbose
        self.in_section = None

    def ok(self, what):
        self.passed += 1
        self.in_section[0] += 1
        if self.verbose:
            print(f"  ok    {what}")

    def fail(self, what):
        self.failed.append(what)
        if self.in_section is not None:
            self.in_section[1] += 1
        print(f"  FAIL  {what}")

    def check(self, cond, what, why=""):
        if cond:
            self.ok(what)
        else:
            self.fail(what + (f": {why}" if why else ""))
        return cond

    def section(self, title, *checks):
        self.end_section()
        print(f"\n== {title}")
        for c in checks:
            print(f"   - {c}")
        self.in_section = [0, 0]

    def end_section(self):
        if self.in_section is not None and sum(self.in_section):
            print(f"   -> {self.in_section[0]} ok, {self.in_section[1]} failing")
        self.in_section = None

    def summary(self, name):
        """Prints the failures and the counts; the exit status."""
        self.end_section()
        print()
        if self.failed:
            print(f"{len(self.failed)} check(s) failed:")
            for f in self.failed:
                print(f"  - {f}")
        print(f"{name}: {self.passed} passed, {len(self.failed)} failed")
        return 1 if self.failed else 0


class QuietReport(Report):
    """A Report that prints nothing, for checks run on a copy broken on
    purpose: their failures are what a self-test looks at."""

    def __init__(self):
        super().__init__()
        self.in_section = [0, 0]

    def fail(self, what):
        self.failed.append(what)


# ---------------------------------------------------------------- loading

def find_kustomize():
    """A command (list) that renders a kustomization directory to stdout."""
    cand = os.environ.get("KUSTOMIZE")
    if cand:
        return [cand, "build"]
    path = shutil.which("kustomize")
    if path:
        return [path, "build"]
    try:
        gopath = subprocess.run(["go", "env", "GOPATH"], capture_output=True,
                                text=True, check=True).stdout.strip()
        gobin = Path(gopath) / "bin" / "kustomize"
        if gobin.exists():
            return [str(gobin), "build"]
    except (OSError, subprocess.CalledProcessError):
        pass
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


def render(overlay, kustomize, component=None):
    """The overlay rendered, alone or with a component (through a kustomization
    made for the purpose, which names both by relative path as kustomize requires)."""
    if component == "snapshot-metadata":
        # Its TLS material is made once by the component's script, not kept
        # in git; a fresh clone has none yet.
        made = subprocess.run([str(DEPLOY / "components" / component / "make-certs.sh")],
                              capture_output=True, text=True)
        if made.returncode != 0:
            raise RuntimeError(f"make-certs.sh failed: {made.stderr.strip()}")
    with tempfile.TemporaryDirectory() as tmp:
        target = DEPLOY / "overlays" / overlay
        if component:
            rel = os.path.relpath(DEPLOY, tmp)
            Path(tmp, "kustomization.yaml").write_text(
                "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
                f"resources:\n  - {rel}/overlays/{overlay}\n"
                f"components:\n  - {rel}/components/{component}\n")
            target = tmp
        out = subprocess.run(kustomize + [str(target)], capture_output=True, text=True)
    if out.returncode != 0:
        what = f"{overlay} with {component}" if component else overlay
        raise RuntimeError(f"kustomize failed for {what}: {out.stderr.strip()}")
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def render_all():
    """Each flavor, alone and with each component it takes: the chart's
    renderings, or without helm the kustomize tree written from them (None
    without either)."""
    names = [(o, c) for o in OVERLAYS for c in [None] + [c for c in COMPONENTS if o in COMPONENT_OVERLAYS[c]]]
    helm = generate.find_tool(None, "HELM", "helm")
    if helm:
        return {f"{o}+{c}" if c else o: [d for _, d in generate.render_tree(helm, o, [c] if c else [])[1]]
                for o, c in names}
    kustomize = find_kustomize()
    if kustomize is None:
        return None
    return {f"{o}+{c}" if c else o: render(o, kustomize, c) for o, c in names}


def load_file(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def pod_workloads(docs):
    for d in docs:
        if d.get("kind") in WORKLOAD_KINDS:
            yield d, d["spec"]["template"]["spec"]
        elif d.get("kind") == "Pod":
            yield d, d["spec"]


def wname(d):
    return f"{d['kind']}/{d['metadata']['name']}"


def containers(spec):
    return list(spec.get("initContainers") or []) + list(spec.get("containers") or [])


def is_driver(c):
    return c.get("name") == DRIVER_CONTAINER or c.get("image", "").startswith(DRIVER_IMAGE_REPO + ":")


def flag_values(c):
    """{'--name': [value or None, ...]} for --name=value and bare --name args.

    A value in the next argument (--name value) is refused: the manifests
    write every flag as --name=value so that a flag and its value cannot
    be told apart wrongly."""
    flags, stray = {}, []
    for a in (c.get("command") or [])[1:] + list(c.get("args") or []):
        a = str(a)
        if a.startswith("-"):
            name, sep, value = a.partition("=")
            if not name.startswith("--"):
                name = "-" + name  # -v=2 and --v=2 are the same Go flag
            flags.setdefault(name, []).append(value if sep else None)
        else:
            stray.append(a)
    return flags, stray


def flag(c, name, default=None):
    vals = flag_values(c)[0].get(name)
    if not vals:
        return default
    return vals[-1] if vals[-1] is not None else "true"


def setting(c, name, env_name):
    """A driver setting given as --name=value or through its environment variable."""
    v = flag(c, name)
    if v is not None:
        return v
    for e in c.get("env") or []:
        if e["name"] == env_name:
            return e.get("value")
    return None


def expand_env(c, value):
    """Expand $(VAR) the way kubelet does, from the container's env."""
    env = {e["name"]: e for e in c.get("env") or []}

    def sub(m):
        e = env.get(m.group(1))
        if e is None:
            raise KeyError(m.group(1))
        if "value" in e:
            return e["value"]
        return "<" + m.group(1) + ">"
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, value)


def resolve_path(spec, c, path):
    """(volume name, path inside the volume) of a path in container c."""
    best = None
    for m in c.get("volumeMounts") or []:
        mp = m["mountPath"].rstrip("/") or "/"
        if path == mp or path.startswith(mp + "/"):
            if best is None or len(mp) > len(best[1]):
                best = (m, mp)
    if best is None:
        return None
    m, mp = best
    rel = path[len(mp):].lstrip("/")
    if m.get("subPath"):
        rel = m["subPath"].rstrip("/") + ("/" + rel if rel else "")
    return m["name"], rel


def nested_bidirectional(c):
    """Bidirectional mounts of container c inside another Bidirectional one."""
    bi = [m["mountPath"].rstrip("/") or "/" for m in c.get("volumeMounts") or []
          if m.get("mountPropagation") == "Bidirectional"]
    return [f"{inner} inside {outer}" for outer in bi for inner in bi
            if inner != outer and inner.startswith(outer.rstrip("/") + "/")]


def volume(spec, name):
    for v in spec.get("volumes") or []:
        if v["name"] == name:
            return v
    return None


def run_as(spec, c):
    """(runAsNonRoot, runAsUser, runAsGroup) of a container: its own settings
    over the pod's."""
    pod = spec.get("securityContext") or {}
    sc = c.get("securityContext") or {}
    return tuple(sc.get(k, pod.get(k)) for k in ("runAsNonRoot", "runAsUser", "runAsGroup"))


def runs_as_non_root(spec, c):
    non_root, uid, _ = run_as(spec, c)
    return non_root is True and isinstance(uid, int) and uid > 0


def groups(spec, c):
    """The groups the manifests put a container's processes in: its runAsGroup,
    the pod's supplementalGroups and fsGroup (the image's own group is not
    known here)."""
    pod = spec.get("securityContext") or {}
    out = set(pod.get("supplementalGroups") or [])
    for g in (pod.get("fsGroup"), run_as(spec, c)[2]):
        if g is not None:
            out.add(g)
    return out


def is_registrar(c):
    return c.get("image", "").startswith(REGISTRAR_IMAGE)


def port_number(c, port):
    if isinstance(port, int):
        return port
    for p in c.get("ports") or []:
        if p.get("name") == port:
            return p["containerPort"]
    return None


def endpoint_port(addr):
    m = re.search(r":(\d+)$", addr or "")
    return int(m.group(1)) if m else None


# ---------------------------------------------------------------- schemas

class SchemaValidator:
    def __init__(self, versions, report):
        import jsonschema
        import kubernetes_validate
        from kubernetes_validate import utils as kv_utils
        self.jsonschema = jsonschema
        self.kv = kubernetes_validate
        self.report = report
        available = sorted({kv_utils.major_minor(v) for v in kv_utils.all_versions()},
                           key=lambda s: tuple(int(x) for x in s.split(".")))
        print(f"kubernetes-validate {kubernetes_validate.version.__version__}: "
              f"schemas for Kubernetes {', '.join(available)}")
        self.versions = []
        for v in versions:
            mm = kv_utils.major_minor(v)
            if mm in available:
                self.versions.append(mm)
            else:
                newest = available[-1]
                print(f"NOTE: kubernetes-validate has no schemas for Kubernetes {mm}; "
                      f"validating against the newest it has, {newest}, instead")
                self.versions.append(newest)
        self.versions = list(dict.fromkeys(self.versions))
        self.crd = {}
        for key, fname in CRD_SCHEMAS.items():
            with open(DEPLOY / "schemas" / fname) as f:
                schema = json.load(f)
            jsonschema.Draft202012Validator.check_schema(schema)
            self.crd[key] = jsonschema.Draft202012Validator(schema)

    def validate(self, origin, doc):
        key = (doc.get("apiVersion"), doc.get("kind"))
        what = f"{origin}: {doc['kind']}/{doc['metadata'].get('name')}"
        if key in self.crd:
            errors = sorted(self.crd[key].iter_errors(doc), key=lambda e: list(e.path))
            self.report.check(not errors, f"{what} valid against deploy/schemas/{CRD_SCHEMAS[key]}",
                              "; ".join(f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors[:3]))
            return
        if doc.get("kind") in SKIPPED_KINDS:
            print(f"  skip  {what}: {SKIPPED_KINDS[doc['kind']]}")
            return
        for v in self.versions:
            try:
                self.kv.validate(doc, v, strict=True)
                self.report.ok(f"{what} valid for Kubernetes {v} (strict)")
            except self.kv.ValidationError as e:
                path = ".".join(str(p) for p in e.path)
                self.report.fail(f"{what} invalid for Kubernetes {v}: {path}: {e.message}")
            except self.kv.SchemaNotFoundError:
                self.report.fail(f"{what}: no Kubernetes {v} schema for {key[0]} {key[1]} "
                                 "(wrong apiVersion, or add a schema or a listed skip)")


# ---------------------------------------------------------------- checks

def check_security(name, docs, r):
    privileged = []
    for d, spec in pod_workloads(docs):
        w = wname(d)
        for k in ("hostNetwork", "hostPID", "hostIPC"):
            r.check(not spec.get(k), f"{name}: {w} has no {k}")
        for c in containers(spec):
            cn = f"{w}/{c['name']}"
            sc = c.get("securityContext") or {}
            if sc.get("privileged"):
                privileged.append((d["kind"], d["metadata"]["name"], c["name"]))
            else:
                r.check(sc.get("allowPrivilegeEscalation") is False,
                        f"{name}: {cn} not privileged and allowPrivilegeEscalation: false")
                caps = sc.get("capabilities") or {}
                r.check("ALL" in (caps.get("drop") or []) and not caps.get("add"),
                        f"{name}: {cn} drops ALL capabilities and adds none", str(caps))
                for m in c.get("volumeMounts") or []:
                    if m.get("mountPropagation") == "Bidirectional":
                        r.fail(f"{name}: {cn} mounts {m['mountPath']} Bidirectional "
                               "without being privileged (the API server rejects it)")
            if not is_driver(c):
                r.check(sc.get("readOnlyRootFilesystem") is True,
                        f"{name}: sidecar {cn} has readOnlyRootFilesystem: true")
            non_root, uid, _ = run_as(spec, c)
            if is_registrar(c):
                r.check(not runs_as_non_root(spec, c),
                        f"{name}: {cn} (node-driver-registrar) runs as root",
                        "it makes its registration socket in the kubelet's root-owned plugins_registry")
            elif not sc.get("privileged") and not (
                    is_driver(c) and (d["kind"], d["metadata"]["name"], flag(c, "--mode", "all")) in ROOT_DRIVERS):
                r.check(runs_as_non_root(spec, c),
                        f"{name}: {cn} runs as a non-root user (runAsNonRoot: true, runAsUser not 0)",
                        f"runAsNonRoot {non_root}, runAsUser {uid}")
            for m in c.get("volumeMounts") or []:
                secret = (volume(spec, m["name"]) or {}).get("secret")
                if secret is not None and runs_as_non_root(spec, c):
                    check_secret_readable(name, cn, spec, c, m["name"], secret, r)
            res = c.get("resources") or {}
            missing = [f"{kind}.{rname}" for kind in ("requests", "limits")
                       for rname in ("cpu", "memory") if rname not in (res.get(kind) or {})]
            r.check(not missing, f"{name}: {cn} has cpu/memory requests and limits",
                    "missing " + ", ".join(missing))
    expected = [("DaemonSet", "example-csi-node", DRIVER_CONTAINER)]
    r.check(privileged == expected,
            f"{name}: the node plugin's driver container is the only privileged container",
            f"privileged: {privileged}")


def check_secret_readable(name, cn, spec, c, vname, secret, r):
    """A Secret a non-root container mounts is readable by it: its files are
    the pod's fsGroup's, the container is in that group and the mode lets the
    group read, or the mode lets anyone read."""
    default = secret.get("defaultMode", 0o644)
    modes = [i.get("mode", default) for i in secret.get("items") or []] or [default]
    fs_group = (spec.get("securityContext") or {}).get("fsGroup")
    by_group = fs_group is not None and fs_group in groups(spec, c)
    readable = all(m & 0o004 or (by_group and m & 0o040) for m in modes)
    r.check(readable, f"{name}: {cn} (non-root) can read the Secret volume {vname}",
            f"mode {' '.join(oct(m) for m in modes)}, pod fsGroup {fs_group}, "
            f"the container's groups {sorted(groups(spec, c))}")


def check_socket_group(name, docs, r):
    """The driver's socket is 0660: a non-root sidecar reaches it through its
    group, the one the driver gives it to (--socket-group), and the driver can
    give it to that group (privileged, or in it: without CAP_CHOWN a process
    gives a file only to a group it is in)."""
    for d, spec in pod_workloads(docs):
        w = wname(d)
        cs = containers(spec)
        drivers = [c for c in cs if is_driver(c)]
        if len(drivers) != 1:
            continue  # check_pods reports it
        drv = drivers[0]
        try:
            endpoint = expand_env(drv, flag(drv, "--endpoint", ""))
        except KeyError:
            continue  # check_pods reports it
        if not endpoint.startswith("unix://"):
            continue
        where = resolve_path(spec, drv, endpoint[len("unix://"):])
        clients = []
        for c in cs:
            addr = flag(c, "--csi-address")
            if c is drv or addr is None or not runs_as_non_root(spec, c):
                continue
            try:
                addr = expand_env(c, addr)
            except KeyError:
                continue
            if addr.startswith("unix://"):
                addr = addr[len("unix://"):]
            if resolve_path(spec, c, addr) == where:
                clients.append(c)
        if not clients:
            continue
        names = ", ".join(c["name"] for c in clients)
        group = setting(drv, "--socket-group", "CSI_SOCKET_GROUP")
        if not r.check(group is not None and group.isdigit() and int(group) > 0,
                       f"{name}: {w} driver gives its socket to a group (--socket-group): "
                       f"the non-root {names} connect to it",
                       f"--socket-group {group}"):
            continue
        gid = int(group)
        for c in clients:
            r.check(gid in groups(spec, c),
                    f"{name}: {w}/{c['name']} (non-root) is in the socket's group {gid}",
                    f"its groups (runAsGroup, the pod's supplementalGroups, fsGroup): {sorted(groups(spec, c))}")
        r.check((drv.get("securityContext") or {}).get("privileged") is True or gid in groups(spec, drv),
                f"{name}: {w} driver may give its socket to group {gid}: privileged, or in the group "
                "(runAsGroup, supplementalGroups or fsGroup)",
                f"its groups: {sorted(groups(spec, drv))}")


def check_self_test(rendered, r):
    """The security checks find a broken manifest: a copy of a rendering with
    one thing broken fails them, where the rendering itself passes (a test of
    this test)."""
    import copy
    base = SELF_TEST_RENDERING
    if base not in rendered:
        print(f"  skip  no rendering named {base} to break")
        return

    def run(docs):
        q = QuietReport()
        check_security(base, docs, q)
        check_socket_group(base, docs, q)
        return q.failed

    def mutated(change):
        docs = copy.deepcopy(rendered[base])
        change(docs)
        return run(docs)

    def pod(docs):
        d = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "example-csi-controller")
        return d["spec"]["template"]["spec"]

    def container(docs, cname):
        return next(c for c in pod(docs)["containers"] if c["name"] == cname)

    found = run(rendered[base])
    r.check(not found, f"self-test: {base} itself passes", "; ".join(found))

    def root_sidecar(docs):
        del container(docs, "csi-provisioner")["securityContext"]["runAsNonRoot"]
    found = mutated(root_sidecar)
    r.check(len(found) == 1 and "csi-provisioner runs as a non-root user" in found[0],
            "self-test: a sidecar without runAsNonRoot is reported", "; ".join(found) or "not found")

    def no_socket_group(docs):
        drv = container(docs, DRIVER_CONTAINER)
        drv["args"] = [a for a in drv["args"] if not a.startswith("--socket-group")]
    found = mutated(no_socket_group)
    r.check(len(found) == 1 and "gives its socket to a group (--socket-group)" in found[0],
            "self-test: a driver without --socket-group is reported", "; ".join(found) or "not found")

    def no_fs_group(docs):
        del pod(docs)["securityContext"]["fsGroup"]
    found = mutated(no_fs_group)
    r.check(any("driver may give its socket to group" in f for f in found)
            and any("can read the Secret volume snapshot-metadata-tls" in f for f in found),
            "self-test: a root driver without the socket's group (no CAP_CHOWN), and a Secret its "
            "non-root reader cannot read, are reported", "; ".join(found) or "not found")

    def stacked_pools(docs):
        ds = next(d for d in docs if d["kind"] == "DaemonSet")
        drv = next(c for c in containers(ds["spec"]["template"]["spec"]) if is_driver(c))
        for m in drv["volumeMounts"]:
            if m["name"] in ("data-dir", "pool-default"):
                m["mountPropagation"] = "Bidirectional"
    docs = copy.deepcopy(rendered[base])
    q = QuietReport()
    check_pods(base, docs, q)
    r.check(not q.failed, f"self-test: {base} passes the checks inside each pod", "; ".join(q.failed))
    stacked_pools(docs)
    q = QuietReport()
    check_pods(base, docs, q)
    r.check(any("mounts pool /var/lib/example-csi/pool" in f for f in q.failed)
            and any("/var/lib/example-csi/pool inside /var/lib/example-csi" in f for f in q.failed),
            "self-test: a pool mounted Bidirectional inside the Bidirectional data directory is reported",
            "; ".join(q.failed) or "not found")

    def key_for_root_only(docs):
        v = next(v for v in pod(docs)["volumes"] if v["name"] == "snapshot-metadata-tls")
        v["secret"]["defaultMode"] = 0o400
    found = mutated(key_for_root_only)
    r.check(len(found) == 1 and "can read the Secret volume snapshot-metadata-tls" in found[0],
            "self-test: a Secret mode only its owner (root) may read, mounted by a non-root sidecar, is reported",
            "; ".join(found) or "not found")


def check_images(name, docs, crate_version, r, seen_tags):
    for d, spec in pod_workloads(docs):
        for c in containers(spec):
            cn = f"{wname(d)}/{c['name']}"
            image = c.get("image", "")
            # repository:tag, or repository:tag@digest where an operator pins
            # digests (the tag stays: it names the version the checks compare).
            ref, _, digest = image.partition("@")
            repo, _, tag = ref.rpartition(":")
            if "/" in tag or not repo:
                repo, tag = ref, ""
            if digest or name.endswith("+digests"):
                r.check(re.fullmatch(r"sha256:[0-9a-f]{64}", digest) is not None,
                        f"{name}: {cn} image {image} pinned by a sha256 digest beside its tag")
            if not r.check(bool(tag) and tag != "latest",
                           f"{name}: {cn} image {image} pinned to a version"):
                continue
            if is_driver(c):
                r.check(repo == DRIVER_IMAGE_REPO and tag == f"v{crate_version}",
                        f"{name}: {cn} runs {DRIVER_IMAGE_REPO}:v{crate_version} (crate version)",
                        f"found {image}")
            else:
                r.check(image.startswith(SIDECAR_REGISTRY),
                        f"{name}: {cn} image comes from {SIDECAR_REGISTRY}", image)
            if repo in seen_tags and seen_tags[repo][0] != tag:
                r.fail(f"{name}: {cn} uses {repo}:{tag} but {seen_tags[repo][1]} uses "
                       f"{repo}:{seen_tags[repo][0]}")
            seen_tags.setdefault(repo, (tag, f"{name} {cn}"))


def check_pods(name, docs, r):
    """Sockets, ports, env references and sidecar flags inside each pod."""
    csidriver = next((d for d in docs if d["kind"] == "CSIDriver"), None)
    for d, spec in pod_workloads(docs):
        w = wname(d)
        cs = containers(spec)
        drivers = [c for c in cs if is_driver(c)]
        if not r.check(len(drivers) == 1, f"{name}: {w} has exactly one driver container"):
            continue
        drv = drivers[0]
        # Every $(VAR) has a definition.
        for c in cs:
            for a in list(c.get("args") or []):
                try:
                    expand_env(c, str(a))
                except KeyError as e:
                    r.fail(f"{name}: {w}/{c['name']} argument {a} uses $({e.args[0]}), not in its env")
        for c in cs:
            stray = flag_values(c)[1]
            r.check(not stray, f"{name}: {w}/{c['name']} writes every flag as --name=value",
                    f"stray arguments {stray}")
        # The driver's endpoint.
        endpoint = expand_env(drv, flag(drv, "--endpoint", ""))
        if not r.check(endpoint.startswith("unix:///"),
                       f"{name}: {w} driver --endpoint is a unix socket ({endpoint})"):
            continue
        sock = endpoint[len("unix://"):]
        where = resolve_path(spec, drv, sock)
        if not r.check(where is not None, f"{name}: {w} driver socket {sock} is on a volume"):
            continue
        r.check(flag(drv, "--drivername", DRIVER_NAME) == DRIVER_NAME
                and csidriver is not None and csidriver["metadata"]["name"] == DRIVER_NAME,
                f"{name}: {w} driver name {DRIVER_NAME} matches the CSIDriver object")
        mode = flag(drv, "--mode", "all")
        allowed = {"DaemonSet": {"node", "all"}, "Deployment": {"controller", "all", "router"},
                   "StatefulSet": {"controller", "all"}}.get(d["kind"], {"all"})
        r.check(mode in allowed, f"{name}: {w} driver --mode={mode} fits a {d['kind']}")
        for c in cs:
            if c is drv:
                continue
            addr = flag(c, "--csi-address")
            cn = f"{w}/{c['name']}"
            if not r.check(addr is not None, f"{name}: {cn} has --csi-address"):
                continue
            addr = expand_env(c, addr)
            if addr.startswith("unix://"):
                addr = addr[len("unix://"):]
            r.check(resolve_path(spec, c, addr) == where,
                    f"{name}: {cn} --csi-address {addr} is the driver's socket {sock}",
                    f"{resolve_path(spec, c, addr)} != {where}")
        # Registration with the kubelet: by node-driver-registrar, or by the driver
        # itself (--kubelet-registration-dir); either way kubelet's path to the
        # socket is the socket's host path, and plugins_registry is mounted where
        # the registration socket is made.
        registrations = [(c, flag(c, "--kubelet-registration-path"), "/registration") for c in cs
                         if c is not drv and flag(c, "--kubelet-registration-path") is not None]
        builtin_dir = setting(drv, "--kubelet-registration-dir", "CSI_KUBELET_REGISTRATION_DIR")
        if builtin_dir:
            registrations.append((drv, setting(drv, "--kubelet-registration-path",
                                               "CSI_KUBELET_REGISTRATION_PATH"), builtin_dir))
        if d["kind"] == "DaemonSet":
            r.check(len(registrations) == 1,
                    f"{name}: {w} registers with the kubelet exactly once (registrar or built-in)",
                    f"{len(registrations)} registrations")
        else:
            r.check(not registrations, f"{name}: {w} (not a node plugin) does not register with the kubelet")
        for c, reg, reg_dir_path in registrations:
            cn = f"{w}/{c['name']}"
            vol = volume(spec, where[0]) or {}
            host = (vol.get("hostPath") or {}).get("path")
            host_sock = f"{host.rstrip('/')}/{where[1]}" if host else None
            r.check(reg == host_sock,
                    f"{name}: {cn} registration path {reg} is the driver socket's hostPath",
                    f"socket volume {where[0]} is {host_sock}")
            r.check(reg == f"{KUBELET_DIR}/plugins/{DRIVER_NAME}/csi.sock",
                    f"{name}: {cn} registers {KUBELET_DIR}/plugins/{DRIVER_NAME}/csi.sock")
            reg_dir = resolve_path(spec, c, reg_dir_path)
            regvol = volume(spec, reg_dir[0]) if reg_dir else None
            r.check(regvol is not None and reg_dir[1] == ""
                    and (regvol.get("hostPath") or {}).get("path") == f"{KUBELET_DIR}/plugins_registry",
                    f"{name}: {cn} has {KUBELET_DIR}/plugins_registry at {reg_dir_path}")
        # Liveness: the driver's probe goes to the livenessprobe sidecar, or, without
        # one, to the driver's own /healthz on its metrics port.
        probes = [c for c in cs if c.get("image", "").startswith(SIDECAR_REGISTRY + "livenessprobe:")]
        lp = drv.get("livenessProbe") or {}
        r.check("httpGet" in lp and lp["httpGet"].get("path") == "/healthz",
                f"{name}: {w} driver has an HTTP livenessProbe on /healthz")
        probed = port_number(drv, (lp.get("httpGet") or {}).get("port"))
        if len(probes) == 1:
            served = endpoint_port(flag(probes[0], "--http-endpoint")) or \
                int(flag(probes[0], "--health-port", "9808"))
            r.check(probed == served,
                    f"{name}: {w} driver probe port {probed} is livenessprobe's port {served}")
        elif r.check(not probes, f"{name}: {w} has at most one livenessprobe sidecar"):
            own = endpoint_port(setting(drv, "--metrics-address", "CSI_METRICS_ADDRESS"))
            r.check(own is not None and probed == own,
                    f"{name}: {w} driver probe port {probed} is its own --metrics-address port {own} "
                    "(no livenessprobe sidecar)")
        for c in cs:
            probe = c.get("livenessProbe") or {}
            port = (probe.get("httpGet") or {}).get("port")
            if port is not None:
                r.check(port_number(c, port) is not None,
                        f"{name}: {w}/{c['name']} probe port {port} is declared by the container")
        metrics = setting(drv, "--metrics-address", "CSI_METRICS_ADDRESS")
        if metrics:
            mport = endpoint_port(metrics)
            r.check(any(p["containerPort"] == mport for p in drv.get("ports") or []),
                    f"{name}: {w} driver metrics port {mport} is declared")
            r.check(not metrics.startswith("127.") and not metrics.startswith("localhost"),
                    f"{name}: {w} driver metrics listen on the pod's address ({metrics})")
        # Sidecar-specific flags.
        for c in cs:
            image = c.get("image", "")
            cn = f"{w}/{c['name']}"
            f, _ = flag_values(c)
            env = {e["name"] for e in c.get("env") or []}
            if "--node-deployment" in f and flag(c, "--node-deployment") != "false":
                r.check(d["kind"] == "DaemonSet", f"{name}: {cn} in node-deployment mode runs in a DaemonSet")
                r.check("NODE_NAME" in env, f"{name}: {cn} in node-deployment mode has NODE_NAME")
                r.check("--leader-election" not in f,
                        f"{name}: {cn} in node-deployment mode has no leader election")
            if "--enable-capacity" in f:
                r.check({"NAMESPACE", "POD_NAME"} <= env,
                        f"{name}: {cn} with --enable-capacity has NAMESPACE and POD_NAME")
            if SIDECAR_REGISTRY + "csi-snapshotter:" in image and d["kind"] != "DaemonSet":
                r.check(flag(c, "--feature-gates", "").find("CSIVolumeGroupSnapshot=true") >= 0,
                        f"{name}: {cn} has volume group snapshots on")
        if d["kind"] == "DaemonSet":
            r.check(spec.get("priorityClassName") == "system-node-critical",
                    f"{name}: {w} has priorityClassName system-node-critical")
            r.check(any(t.get("operator") == "Exists" and not t.get("key")
                        for t in spec.get("tolerations") or []),
                    f"{name}: {w} tolerates every taint")
            mounts = {m["mountPath"]: m for m in drv.get("volumeMounts") or []}
            for p in (f"{KUBELET_DIR}/pods", f"{KUBELET_DIR}/plugins"):
                m = mounts.get(p)
                vol = volume(spec, m["name"]) if m else None
                r.check(m is not None and m.get("mountPropagation") == "Bidirectional"
                        and (vol.get("hostPath") or {}).get("path") == p,
                        f"{name}: {w} driver mounts host {p} with Bidirectional propagation")
            m = mounts.get("/dev")
            r.check(m is not None and (volume(spec, m["name"]).get("hostPath") or {}).get("path") == "/dev",
                    f"{name}: {w} driver mounts the host's /dev")
            for spec_pool in flag_values(drv)[0].get("--pool") or []:
                path = (spec_pool or "").partition("=")[2] or spec_pool
                pw = resolve_path(spec, drv, path)
                pv = volume(spec, pw[0]) if pw else None
                r.check(pv is not None and "hostPath" in pv,
                        f"{name}: {w} pool {path} is on a hostPath")
                # The driver makes no mount in a pool: a disk mounted there
                # on the host reaches it (HostToContainer), nothing goes back.
                covering = [m for m in drv.get("volumeMounts") or []
                            if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
                r.check(bool(covering) and all(m.get("mountPropagation") == "HostToContainer" for m in covering),
                        f"{name}: {w} driver mounts pool {path} (and every directory above it) HostToContainer",
                        ", ".join(f"{m['mountPath']}: {m.get('mountPropagation', 'None')}" for m in covering))
        for c in containers(spec):
            r.check(not nested_bidirectional(c),
                    f"{name}: {w}/{c['name']} has no Bidirectional mount inside another one "
                    "(each start would stack one more copy of it on the host)",
                    "; ".join(nested_bidirectional(c)))


def check_overlay_flags(name, docs, r):
    """Flags that must agree across the pods of one overlay."""
    csidriver = next((d for d in docs if d["kind"] == "CSIDriver"), None)
    if not r.check(csidriver is not None, f"{name}: has the CSIDriver object"):
        return
    s = csidriver["spec"]
    all_c = [(d, c) for d, spec in pod_workloads(docs) for c in containers(spec)]
    drivers = [c for _, c in all_c if is_driver(c)]
    # Inline ephemeral volumes are on exactly where the node plugin is given
    # pools for them.
    inline = any(e.get("name") == "CSI_EPHEMERAL_POOLS" and e.get("value")
                 for c in drivers for e in c.get("env") or [])
    modes = ["Ephemeral", "Persistent"] if inline else ["Persistent"]
    r.check(s.get("podInfoOnMount") is True and s.get("fsGroupPolicy") == "File"
            and sorted(s.get("volumeLifecycleModes") or []) == modes
            and s.get("requiresRepublish") is False and s.get("seLinuxMount") is True
            and "nodeAllocatableUpdatePeriodSeconds" not in s,
            f"{name}: CSIDriver has podInfoOnMount, fsGroupPolicy File, {'+'.join(modes)} "
            "(Ephemeral only with CSI_EPHEMERAL_POOLS), requiresRepublish false, seLinuxMount true, "
            "no nodeAllocatableUpdatePeriodSeconds")
    images = [c.get("image", "") for _, c in all_c]
    attach = any("--enable-attach" in flag_values(c)[0] for c in drivers)
    attacher = any(SIDECAR_REGISTRY + "csi-attacher:" in i for i in images)
    r.check(s.get("attachRequired") is attach and attacher == attach,
            f"{name}: attachRequired={s.get('attachRequired')}, driver --enable-attach={attach}, "
            f"external-attacher present={attacher} agree")
    capacity = any("--enable-capacity" in flag_values(c)[0] for _, c in all_c)
    r.check(bool(s.get("storageCapacity")) == capacity,
            f"{name}: storageCapacity={s.get('storageCapacity')} agrees with --enable-capacity={capacity}")
    node_deployment = any(flag(c, "--node-deployment", "false") != "false" for _, c in all_c)
    if node_deployment:
        r.check(all("--disable-controller-expansion" in flag_values(c)[0] for c in drivers),
                f"{name}: every driver runs with --disable-controller-expansion "
                "(the resizer cannot reach the volume's node)")
    for kind, img in (("provisioner", "csi-provisioner"), ("resizer", "csi-resizer"),
                      ("snapshotter", "csi-snapshotter")):
        r.check(any(SIDECAR_REGISTRY + img + ":" in i for i in images),
                f"{name}: runs external {kind} ({img})")
    builtin = any(setting(c, "--kubelet-registration-dir", "CSI_KUBELET_REGISTRATION_DIR")
                  for c in drivers)
    registrar = any(SIDECAR_REGISTRY + "csi-node-driver-registrar:" in i for i in images)
    r.check(registrar != builtin,
            f"{name}: registers with the kubelet through node-driver-registrar or the driver's "
            f"built-in registration, not both (registrar={registrar}, built-in={builtin})")


def rbac_rules_for(docs, sa, namespace):
    """(cluster rules, namespaced rules in `namespace`) bound to a ServiceAccount."""
    roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d
             for d in docs if d["kind"] in ("Role", "ClusterRole")}
    cluster, local = [], []
    for b in docs:
        if b["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        if not any(s.get("kind") == "ServiceAccount" and s.get("name") == sa
                   and s.get("namespace", b["metadata"].get("namespace")) == namespace
                   for s in b.get("subjects") or []):
            continue
        ref = b["roleRef"]
        ns = b["metadata"].get("namespace") if ref["kind"] == "Role" else None
        role = roles.get((ref["kind"], ns, ref["name"]))
        rules = (role or {}).get("rules") or []
        (local if b["kind"] == "RoleBinding" else cluster).extend(rules)
    return cluster, local


def allows(rules, group, resource, verb):
    return any(group in r.get("apiGroups", []) and resource in r.get("resources", [])
               and verb in r.get("verbs", []) for r in rules)


MESH_SECRETS = ["example-csi-mesh", "example-csi-mesh-node"]


def mesh_secret_rule(role, rule):
    """The one grant on Secrets: the router's namespaced Role may read the
    mesh authorities' Secrets by their names, and create Secrets (a create
    cannot be limited to a name) in its own namespace; nothing else."""
    if role["kind"] != "Role" or rule.get("resources") != ["secrets"]:
        return False
    verbs = rule.get("verbs", [])
    named = rule.get("resourceNames") == MESH_SECRETS and verbs == ["get"]
    create = verbs == ["create"] and not rule.get("resourceNames")
    return named or create


def node_pv_policy(docs, user):
    """Whether a ValidatingAdmissionPolicy bound with Deny holds `user` (a
    ServiceAccount on every node) to PVs of this driver on the node its token
    names: it matches PV creates and updates by that user alone, and judges
    the driver, the node affinity and the token's node."""
    bound = {b["spec"].get("policyName") for b in docs if b["kind"] == "ValidatingAdmissionPolicyBinding"
             and "Deny" in (b["spec"].get("validationActions") or [])}
    for p in docs:
        if p["kind"] != "ValidatingAdmissionPolicy" or p["metadata"]["name"] not in bound:
            continue
        spec = p["spec"]
        rules = (spec.get("matchConstraints") or {}).get("resourceRules") or []
        pv = any("persistentvolumes" in rule.get("resources", []) and {"CREATE", "UPDATE"} <= set(rule.get("operations", []))
                 for rule in rules)
        conditions = " ".join(c["expression"] for c in spec.get("matchConditions") or [])
        judged = " ".join([v["expression"] for v in spec.get("variables") or []]
                          + [v["expression"] for v in spec.get("validations") or []])
        if (pv and f"'{user}'" in conditions and spec.get("failurePolicy") == "Fail"
                and "authentication.kubernetes.io/node-name" in judged and f"'{DRIVER_NAME}'" in judged
                and "topology.example.csi/node" in judged and "hostPath" in judged):
            return True
    return False


def check_rbac(name, docs, r):
    names = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in docs}
    for b in docs:
        if b["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        ref = b["roleRef"]
        ns = b["metadata"].get("namespace") if ref["kind"] == "Role" else None
        r.check((ref["kind"], ns, ref["name"]) in names,
                f"{name}: {b['kind']}/{b['metadata']['name']} refers to an existing {ref['kind']}")
        for s in b.get("subjects") or []:
            r.check(s.get("kind") == "ServiceAccount"
                    and ("ServiceAccount", s.get("namespace"), s.get("name")) in names,
                    f"{name}: {b['kind']}/{b['metadata']['name']} binds an existing ServiceAccount")
    for d in docs:
        if d["kind"] not in ("Role", "ClusterRole"):
            continue
        for rule in d.get("rules") or []:
            bad = [x for x in rule.get("verbs", []) + rule.get("resources", []) + rule.get("apiGroups", [])
                   if x == "*"]
            r.check(not bad, f"{name}: {d['kind']}/{d['metadata']['name']} has no wildcard in "
                    f"{rule.get('resources')}")
            if "secrets" in rule.get("resources", []) and mesh_secret_rule(d, rule):
                continue
            r.check("secrets" not in rule.get("resources", []),
                    f"{name}: {d['kind']}/{d['metadata']['name']} grants nothing on secrets "
                    f"({rule.get('resources')})")
    needs = {
        "csi-provisioner": [("", "persistentvolumes", "create"), ("", "persistentvolumeclaims", "update"),
                            ("storage.k8s.io", "storageclasses", "watch"), ("storage.k8s.io", "csinodes", "watch"),
                            ("", "nodes", "watch"), ("", "events", "create"),
                            ("snapshot.storage.k8s.io", "volumesnapshotcontents", "get"),
                            ("storage.k8s.io", "volumeattributesclasses", "get")],
        "csi-snapshotter": [("snapshot.storage.k8s.io", "volumesnapshotcontents", "patch"),
                            ("snapshot.storage.k8s.io", "volumesnapshotcontents/status", "update"),
                            ("snapshot.storage.k8s.io", "volumesnapshotclasses", "watch"),
                            ("", "events", "create")],
        "csi-resizer": [("", "persistentvolumes", "patch"), ("", "persistentvolumeclaims/status", "patch"),
                        ("", "pods", "watch"), ("storage.k8s.io", "volumeattributesclasses", "watch")],
        "csi-attacher": [("storage.k8s.io", "volumeattachments", "patch"),
                         ("storage.k8s.io", "volumeattachments/status", "patch"),
                         ("", "persistentvolumes", "patch"), ("storage.k8s.io", "csinodes", "get")],
        "csi-snapshot-metadata": [("cbt.storage.k8s.io", "snapshotmetadataservices", "get"),
                                  ("authentication.k8s.io", "tokenreviews", "create"),
                                  ("authorization.k8s.io", "subjectaccessreviews", "create"),
                                  ("snapshot.storage.k8s.io", "volumesnapshots", "get"),
                                  ("snapshot.storage.k8s.io", "volumesnapshotcontents", "get")],
    }
    group_needs = [("groupsnapshot.storage.k8s.io", "volumegroupsnapshotcontents", "patch"),
                   ("groupsnapshot.storage.k8s.io", "volumegroupsnapshotcontents/status", "update"),
                   ("groupsnapshot.storage.k8s.io", "volumegroupsnapshotclasses", "watch")]
    sa_names = {(d["metadata"].get("namespace"), d["metadata"]["name"]): d
                for d in docs if d["kind"] == "ServiceAccount"}
    for d, spec in pod_workloads(docs):
        w = wname(d)
        ns = d["metadata"].get("namespace")
        sa = spec.get("serviceAccountName", "default")
        if not r.check((ns, sa) in sa_names, f"{name}: {w} runs as its own ServiceAccount {sa}"):
            continue
        cluster, local = rbac_rules_for(docs, sa, ns)
        api_users = []
        for c in containers(spec):
            img = c.get("image", "")
            for side, rules in needs.items():
                if SIDECAR_REGISTRY + side + ":" not in img:
                    continue
                api_users.append(c["name"])
                need = list(rules)
                if side == "csi-snapshotter" and "CSIVolumeGroupSnapshot=true" in (flag(c, "--feature-gates") or ""):
                    need += group_needs
                missing = [n for n in need if not allows(cluster, *n)]
                r.check(not missing, f"{name}: {w}/{c['name']} is granted what {side} needs",
                        f"missing {missing}")
                if "--leader-election" in flag_values(c)[0]:
                    r.check(allows(local, "coordination.k8s.io", "leases", "update"),
                            f"{name}: {w}/{c['name']} may use Leases in {ns} for leader election")
                if "--enable-capacity" in flag_values(c)[0]:
                    r.check(allows(local, "storage.k8s.io", "csistoragecapacities", "create")
                            and allows(local, "", "pods", "get"),
                            f"{name}: {w}/{c['name']} may manage CSIStorageCapacity in {ns}")
                    # The owner is found by walking up from the pod: each
                    # level above the pod's owner needs a get of that owner.
                    level = int(flag(c, "--capacity-ownerref-level", "1"))
                    if d["kind"] == "Deployment" and level >= 2:
                        r.check(allows(local, "apps", "replicasets", "get"),
                                f"{name}: {w}/{c['name']} may get its ReplicaSet to find the Deployment owning its capacity objects")
        # The controller's mesh authority signs the controller's role: a
        # node pod that had it would let root on that node act as the
        # controller towards every other node.
        secrets = {v.get("secret", {}).get("secretName") for v in spec.get("volumes") or []}
        if d["kind"] == "DaemonSet":
            r.check(MESH_SECRETS[0] not in secrets,
                    f"{name}: {w} does not mount the controller's mesh Secret {MESH_SECRETS[0]}")
        if d["kind"] == "DaemonSet" and allows(cluster, "", "persistentvolumes", "create"):
            r.check(node_pv_policy(docs, f"system:serviceaccount:{ns}:{sa}"),
                    f"{name}: {w} may create PersistentVolumes on every node: a ValidatingAdmissionPolicy, "
                    f"bound with Deny, limits {ns}/{sa} to PVs of {DRIVER_NAME} pinned to the node its "
                    f"token names")
        if not api_users:
            r.check(not cluster and not local,
                    f"{name}: {w} (no sidecar that uses the API) has no RBAC rules")
            r.check(spec.get("automountServiceAccountToken") is False
                    or sa_names[(ns, sa)].get("automountServiceAccountToken") is False,
                    f"{name}: {w} (no API use) does not mount a ServiceAccount token")


def check_examples(docs_by_file, r):
    sc = {}
    for fname, docs in docs_by_file.items():
        for d in docs:
            if d["kind"] == "StorageClass":
                sc[d["metadata"]["name"]] = d
                r.check(d.get("provisioner") == DRIVER_NAME,
                        f"examples/{fname}: StorageClass provisioner is {DRIVER_NAME}")
                r.check(d.get("volumeBindingMode") == "WaitForFirstConsumer",
                        f"examples/{fname}: StorageClass binds WaitForFirstConsumer (local storage)")
                unknown = [k for k in d.get("parameters") or {}
                           if k not in ("type", "kind") and not k.startswith("csi.storage.k8s.io/")]
                r.check(not unknown, f"examples/{fname}: StorageClass parameters are ones the driver knows",
                        f"unknown {unknown}")
                r.check((d.get("parameters") or {}).get("kind", "image") in ("image", "dir"),
                        f"examples/{fname}: kind is image or dir")
            elif d["kind"] in ("VolumeSnapshotClass", "VolumeGroupSnapshotClass"):
                r.check(d.get("driver") == DRIVER_NAME, f"examples/{fname}: {d['kind']} driver is {DRIVER_NAME}")
            elif d["kind"] == "VolumeAttributesClass":
                r.check(d.get("driverName") == DRIVER_NAME,
                        f"examples/{fname}: VolumeAttributesClass driverName is {DRIVER_NAME}")
                unknown = set(d.get("parameters") or {}) - MUTABLE_PARAMETERS
                r.check(not unknown, f"examples/{fname}: VolumeAttributesClass uses only "
                        f"{sorted(MUTABLE_PARAMETERS)}", f"unknown {sorted(unknown)}")
            elif d["kind"] == "Pod":
                for v in d["spec"].get("volumes") or []:
                    if "csi" in v:
                        r.check(v["csi"].get("driver") == DRIVER_NAME and "size" in (v["csi"].get("volumeAttributes") or {}),
                                f"examples/{fname}: inline volume {v['name']} uses {DRIVER_NAME} with a size")
    main = sc.get("example-csi") or {}
    p = main.get("parameters") or {}
    r.check(p.get("type") == "ssd" and p.get("csi.storage.k8s.io/fstype") == "ext4"
            and main.get("reclaimPolicy") == "Delete" and main.get("allowVolumeExpansion") is True,
            "examples: StorageClass example-csi has type ssd, fstype ext4, Delete, allowVolumeExpansion")
    for fname, docs in docs_by_file.items():
        for d in docs:
            if d["kind"] == "PersistentVolumeClaim":
                r.check(d["spec"].get("storageClassName") in sc,
                        f"examples/{fname}: claim uses an example StorageClass")


def check_binary(binary, flags_in_use, env_in_use, r):
    try:
        out = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30)
    except OSError as e:
        r.fail(f"{binary} --help could not run: {e}")
        return
    text = out.stdout + out.stderr
    r.check(out.returncode == 0, f"{binary} --help exits 0")
    for f in flags_in_use:
        r.check(re.search(re.escape(f) + r"(?![A-Za-z0-9-])", text) is not None,
                f"the binary accepts {f} (in its --help)")
    for e in env_in_use:
        r.check(re.search(r"\[env: " + re.escape(e) + "=", text) is not None,
                f"the binary reads the environment variable {e} (in its --help)")


# ---------------------------------------------------------------- node label domains

# NodeRestriction lets a kubelet set node labels in the kubernetes.io and k8s.io
# domains only from this list (and the two prefixes after it). The kubelet puts
# a CSI driver's topology keys on its Node as labels, so a topology key in those
# domains makes registration fail on every cluster with NodeRestriction on.
KUBELET_ALLOWED_LABELS = {
    "kubernetes.io/hostname", "kubernetes.io/arch", "kubernetes.io/os",
    "beta.kubernetes.io/arch", "beta.kubernetes.io/os", "beta.kubernetes.io/instance-type",
    "node.kubernetes.io/instance-type",
    "failure-domain.beta.kubernetes.io/region", "failure-domain.beta.kubernetes.io/zone",
    "topology.kubernetes.io/region", "topology.kubernetes.io/zone",
}
KUBELET_ALLOWED_PREFIXES = ("kubelet.kubernetes.io/", "node.kubernetes.io/")
TOPOLOGY_KEY_RE = re.compile(r"\btopology\.[A-Za-z0-9.-]+/[A-Za-z0-9._-]+")
SOURCE_SUFFIXES = {".rs", ".proto", ".yaml", ".yml", ".md", ".py", ".sh", ".json", ".tpl", ".txt"}


def reserved_for_kubelet(key):
    """True when NodeRestriction forbids a kubelet to set `key` on its Node."""
    domain, slash, _ = key.partition("/")
    if not slash:
        return False
    domain = domain.lower()
    reserved = any(domain == d or domain.endswith("." + d) for d in ("kubernetes.io", "k8s.io"))
    return reserved and key not in KUBELET_ALLOWED_LABELS and not key.startswith(KUBELET_ALLOWED_PREFIXES)


def node_label_keys(doc):
    """Node label keys an object selects on: nodeSelector, node affinity,
    topology spread constraints, a StorageClass's allowedTopologies."""
    keys = []

    def walk(o):
        if isinstance(o, dict):
            for k, v in o.items():
                if k == "nodeSelector" and isinstance(v, dict):
                    keys.extend(v)
                elif k == "nodeSelectorTerms" and isinstance(v, list):
                    for t in v:
                        for e in (t.get("matchExpressions") or []) + (t.get("matchFields") or []):
                            keys.append(e.get("key", ""))
                elif k == "topologyKey" and isinstance(v, str):
                    keys.append(v)
                elif k == "allowedTopologies" and isinstance(v, list):
                    for t in v:
                        for e in t.get("matchLabelExpressions") or []:
                            keys.append(e.get("key", ""))
                walk(v)
        elif isinstance(o, list):
            for i in o:
                walk(i)

    walk(doc)
    return [k for k in keys if k]


def check_label_domains(rendered, examples, r):
    for origin, docs in list(rendered.items()) + [(f"examples/{n}", d) for n, d in examples.items()]:
        for d in docs:
            for k in node_label_keys(d):
                r.check(not reserved_for_kubelet(k),
                        f"{origin}: {d['kind']} {d['metadata'].get('name')} selects node label {k}",
                        "in a domain NodeRestriction reserves: the kubelet cannot set it")
    seen = 0
    for path in sorted(REPO.rglob("*")):
        rel = path.relative_to(REPO)
        if rel.parts[0] in ("target", ".git") or not path.is_file() or path.suffix not in SOURCE_SUFFIXES:
            continue
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        for m in TOPOLOGY_KEY_RE.finditer(text):
            seen += 1
            r.check(not reserved_for_kubelet(m.group(0)),
                    f"{rel}: topology key {m.group(0)}",
                    "in a domain NodeRestriction reserves: the kubelet cannot label its Node with it")
    r.check(seen > 0, "the driver's topology key is found in the sources")


# ---------------------------------------------------------------- main

def crate_version():
    text = (REPO / "Cargo.toml").read_text()
    m = re.search(r'^\[package\][^\[]*?^version\s*=\s*"([^"]+)"', text, re.M | re.S)
    return m.group(1) if m else None


def driver_settings(rendered, names):
    """Once each, in order, the names(c) of every driver container."""
    seen = []
    for docs in rendered.values():
        for _, spec in pod_workloads(docs):
            for c in containers(spec):
                if is_driver(c):
                    for n in names(c):
                        if n not in seen:
                            seen.append(n)
    return seen


def driver_flags(rendered):
    return driver_settings(rendered, lambda c: flag_values(c)[0])


def driver_env(rendered):
    """The driver's settings given as environment variables (CSI_*)."""
    return driver_settings(rendered, lambda c: [e["name"] for e in c.get("env") or []
                                                if e["name"].startswith("CSI_")])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k8s-version", action="append", dest="versions")
    ap.add_argument("--rendered", action="append", default=[], metavar="NAME=FILE")
    ap.add_argument("--examples", default=str(DEPLOY / "examples"))
    ap.add_argument("--driver-flags", action="store_true")
    ap.add_argument("--check-binary", metavar="PATH")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every check, not only failures")
    args = ap.parse_args()

    rendered = {}
    try:
        if args.rendered:
            for item in args.rendered:
                n, _, f = item.partition("=")
                rendered[n] = load_file(f)
        else:
            rendered = render_all()
            if rendered is None:
                print("no helm or kustomize found (set HELM or KUSTOMIZE, or run deploy/validate.sh once)",
                      file=sys.stderr)
                return 2
    except (OSError, RuntimeError, yaml.YAMLError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    if args.driver_flags:
        for f in driver_flags(rendered):
            print(f)
        return 0

    r = Report(verbose=args.verbose)
    version = crate_version()
    validator = SchemaValidator(args.versions or ["1.35", "1.37"], r)

    def each_overlay(check, *args):
        """Runs check(name, docs, *args) on every rendered overlay."""
        for n, docs in rendered.items():
            check(n, docs, *args)

    examples = {}
    for p in sorted(Path(args.examples).glob("*.yaml")):
        examples[p.name] = load_file(p)

    print("overlays: " + ", ".join(f"{n} ({len(d)} objects)" for n, d in rendered.items()))
    print(f"examples: {len(examples)} files in {args.examples}")

    r.section("schemas",
              "every rendered object and every example, strict (unknown fields rejected), "
              f"for Kubernetes {', '.join(validator.versions)} (kubernetes-validate)",
              "CRD kinds against deploy/schemas/: " + ", ".join(k for _, k in CRD_SCHEMAS),
              "skipped kinds: " + ("; ".join(f"{k}: {v}" for k, v in SKIPPED_KINDS.items()) or "none"))
    for n, docs in rendered.items():
        for d in docs:
            validator.validate(n, d)
    for fname, docs in examples.items():
        for d in docs:
            validator.validate(f"examples/{fname}", d)

    r.section("security posture",
              "only the node plugin's driver container (DaemonSet example-csi-node) is privileged",
              "no hostNetwork, hostPID or hostIPC",
              "allowPrivilegeEscalation: false, capabilities drop ALL and add none where not privileged",
              "Bidirectional mount propagation only in a privileged container",
              "readOnlyRootFilesystem: true on every sidecar",
              "every container runs as a non-root user (runAsNonRoot: true, runAsUser not 0) but the "
              "privileged node driver, node-driver-registrar (root: it writes the kubelet's "
              "plugins_registry) and " + "; ".join(f"{k} {n} --mode={m} ({why})"
                                                    for (k, n, m), why in ROOT_DRIVERS.items()),
              "a Secret a non-root container mounts is readable by it (the pod's fsGroup and a group-readable "
              "mode, or a world-readable mode)",
              "a driver whose socket a non-root sidecar uses gives it to a group (--socket-group) that sidecar "
              "is in (runAsGroup, supplementalGroups or fsGroup), and may (privileged, or in the group)",
              "cpu and memory requests and limits on every container")
    each_overlay(check_security, r)
    each_overlay(check_socket_group, r)
    r.section("self-test of the security checks",
              f"a copy of {SELF_TEST_RENDERING} with a sidecar without runAsNonRoot, a driver without "
              "--socket-group, a pod without the socket's group or a Secret only root may read fails them")
    check_self_test(rendered, r)

    r.section("images",
              "every image pinned to a version (no latest, no missing tag), and where it names a "
              "digest (every image of a +digests rendering: an operator's kustomize images: block), "
              "tag@sha256:<64 hex>",
              f"the driver's image is {DRIVER_IMAGE_REPO}:v{version} (version of Cargo.toml), "
              "the Dockerfile's VERSION the same",
              f"sidecars from {SIDECAR_REGISTRY}, one tag per sidecar across all overlays")
    seen = {}
    each_overlay(check_images, version, r, seen)
    dockerfile = (REPO / "Dockerfile").read_text()
    m = re.search(r'^ARG VERSION=(\S+)$', dockerfile, re.M)
    r.check(m is not None and m.group(1) == version,
            f"the Dockerfile's VERSION is the crate version {version}",
            f"found {m.group(1) if m else 'no ARG VERSION'}")

    r.section("wiring inside each pod",
              "every sidecar's --csi-address is the socket of the driver's --endpoint (same volume, same file)",
              "each node plugin registers exactly once, by node-driver-registrar or by the driver "
              "(--kubelet-registration-dir); the registration path is the socket's hostPath, "
              f"{KUBELET_DIR}/plugins/{DRIVER_NAME}/csi.sock; plugins_registry mounted where the "
              "registration socket is made",
              "the driver's livenessProbe targets the livenessprobe sidecar's port, or without one its "
              "own /healthz on its metrics port; probe ports declared",
              "the driver's --metrics-address port is declared; --mode fits the workload kind",
              "every $(VAR) in args is in the container's env; every flag written --name=value",
              "node-deployment sidecars: DaemonSet, NODE_NAME, no leader election; "
              "--enable-capacity: NAMESPACE and POD_NAME",
              "node plugin: system-node-critical, tolerates all taints, kubelet dirs Bidirectional, "
              "/dev, pools on hostPath mounted HostToContainer (as is every directory above them)",
              "no container mounts Bidirectional inside another Bidirectional mount")
    each_overlay(check_pods, r)

    r.section("CSIDriver and flags across each overlay",
              "podInfoOnMount, fsGroupPolicy File, Persistent (and Ephemeral exactly where the "
              "node plugin has CSI_EPHEMERAL_POOLS), requiresRepublish false, seLinuxMount true, "
              "no nodeAllocatableUpdatePeriodSeconds",
              "attachRequired agrees with --enable-attach and with external-attacher being deployed",
              "storageCapacity agrees with --enable-capacity",
              "with node-deployment provisioning, every driver has --disable-controller-expansion")
    each_overlay(check_overlay_flags, r)

    r.section("RBAC",
              "bindings refer to existing roles and ServiceAccounts; no wildcards; no secrets",
              "each pod runs as its own ServiceAccount, granted what each of its sidecars needs "
              "(from the sidecars' published rbac.yaml), Leases for leader election, "
              "CSIStorageCapacity for capacity tracking",
              "a pod with no API-using sidecar has no rules and mounts no token")
    each_overlay(check_rbac, r)

    r.section("examples",
              f"StorageClasses: provisioner {DRIVER_NAME}, WaitForFirstConsumer, known parameters; "
              "the main one has type ssd, fstype ext4, Delete, allowVolumeExpansion",
              "snapshot classes name the driver; VolumeAttributesClass uses only the mutable parameters",
              "claims use an example StorageClass; the inline volume names the driver and a size")
    check_examples(examples, r)

    r.section("node label domains",
              "every topology key in the sources, the manifests and the examples, and every node label "
              "they select on, is one a kubelet may set under NodeRestriction "
              "(not in kubernetes.io or k8s.io, except the kubelet's own labels)")
    check_label_domains(rendered, examples, r)

    flags = driver_flags(rendered)
    env = driver_env(rendered)
    r.section("flags passed to the driver: " + " ".join(flags),
              "environment settings of the driver: " + " ".join(env))
    if args.check_binary:
        check_binary(args.check_binary, flags, env, r)
    else:
        print("   (not compared with a binary here: give --check-binary PATH; "
              "a Rust test compares `check_manifests.py --driver-flags` with --help)")
    return r.summary("check_manifests")


if __name__ == "__main__":
    sys.exit(main())
