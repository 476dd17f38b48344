#!/usr/bin/env python3
"""The cluster benchmark's measuring client (e2e/run.sh --bench runs it).

It talks to the API server itself (HTTPS with the admin's client certificate,
no kubectl process per call), makes claims and pods as a user would, and
watches pods, claims, PersistentVolumes, the claims' Provisioning Events and
VolumeSnapshots: each moment is the client's clock when the watch delivered
the change, the same for every driver.

Rows, for each driver given, in alternating order round after round:
  single    one claim and its pod at a time: claim created -> pod Running, with
            the phases between (claim Bound, pod scheduled, pod Running), then
            pod deleted -> pod gone -> claim deleted -> PersistentVolume gone
  burst N   N claims with a pod each, made at once: each pod's claim-to-Running,
            the time until all run, claims per minute, the CPU seconds and peak
            resident memory of the driver's and its sidecars' containers; then
            everything deleted and the time until every PersistentVolume is gone
  burst2n N the same with the pods spread evenly over the nodes (--nodes, each
            in turn by nodeSelector), and how many ran on each; reported as row
            burstN-2nodes, or as not measured for a driver that is not
            registered on every node
  snapshot  a pod writes SIZE of random data and ends; a VolumeSnapshot of the
            claim -> readyToUse; a claim restored from it with a pod -> Running
  hold N    N pods with a volume each running for a while: the CPU seconds per
            minute the kubelet's periodic calls cost the driver and sidecars
The CPU and memory figures count the driver's pods that serve the row: its
controller wherever it runs, and its node pods on the row's nodes.

Where the time of each single, burst and burst2n claim goes (phase_* figures,
and the median claim's phases as a table of their own; bench_phases.py):
  schedule_node      claim and pod made -> the claim's selected-node
                     annotation (the scheduler chose a node)
  provisioner_queue  -> the first Provisioning Event about the claim
                     (external-provisioner took it up)
  provision          -> its PersistentVolume (CreateVolume and the PV's write)
  bind               -> the claim Bound
  schedule_pod       -> the pod's nodeName
  mount              -> the pod's PodReadyToStartContainers condition (the
                     kubelet staged and published the volume, made the sandbox)
  start              -> the pod Running
Beside the median claim, for a driver that exports metrics: the mean time of
its CreateVolume, NodeStageVolume and NodePublishVolume calls over the row,
the part of provision and mount that is the driver's own work.

  bench_cluster.py --config FILE --out DIR [--rounds N] [--singles N]
                   [--bursts 50,200] [--snapshot-mib 1024] [--hold-pods 100]
                   [--hold-seconds 180] [--rows single,burst,burst2n,snapshot,hold]
                   [--drivers NAME,...] [--nodes NODE,NODE]

FILE (JSON): {"server", "ca", "cert", "key", "namespace", "node", "nodes",
 "image", "drivers": [{"name", "csi_driver", "class", "snapshot_class",
              "pods_namespace", "pods_selector", "driver_containers": [...],
              "metrics_port", "metrics_selector"}]}
The rows of one node run their pods on "node"; burst2n on "nodes" (or --nodes).
"""

import argparse
import http.client
import json
import os
import ssl
import statistics
import sys
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

from bench_phases import (CLAIM_RPCS, RowBreakdown, claim_moments, median_table, parse_rpc,
                          pod_marks, provisioning_claim, pv_claim, pvc_marks)

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def log(msg):
    print(time.strftime("%H:%M:%S"), "bench:", msg, file=sys.stderr, flush=True)


class Api:
    """A small client of the API server: JSON in, JSON out, and watches."""

    def __init__(self, server, ca, cert, key):
        url = urllib.parse.urlparse(server)
        self.host, self.port = url.hostname, url.port or 443
        self.ctx = ssl.create_default_context(cafile=ca)
        self.ctx.load_cert_chain(cert, key)
        self.local = threading.local()

    def _conn(self):
        c = getattr(self.local, "conn", None)
        if c is None:
            c = http.client.HTTPSConnection(self.host, self.port, context=self.ctx, timeout=120)
            self.local.conn = c
        return c

    def call(self, method, path, body=None, ok=(200, 201, 202), content_type="application/json"):
        data = None if body is None else json.dumps(body).encode()
        for attempt in range(3):
            conn = self._conn()
            try:
                conn.request(method, path, body=data, headers={"Content-Type": content_type})
                resp = conn.getresponse()
                raw = resp.read()
            except (http.client.HTTPException, OSError):
                self.local.conn = None
                if attempt == 2:
                    raise
                continue
            if resp.status == 429 or resp.status >= 500:
                time.sleep(0.2 * (attempt + 1))
                continue
            if resp.status not in ok:
                raise RuntimeError(f"{method} {path}: {resp.status} {raw[:300]!r}")
            return json.loads(raw) if raw else None
        raise RuntimeError(f"{method} {path}: the API server kept refusing")

    def watch(self, path, on_event, stop):
        """Calls on_event(type, object, moment) for every change under path
        from now on, until stop is set; reconnects from the last version."""
        listing = self.call("GET", path)
        version = listing["metadata"]["resourceVersion"]
        for item in listing.get("items", []):
            on_event("ADDED", item, time.monotonic())
        while not stop.is_set():
            conn = http.client.HTTPSConnection(self.host, self.port, context=self.ctx, timeout=None)
            sep = "&" if "?" in path else "?"
            conn.request("GET", f"{path}{sep}watch=1&resourceVersion={version}&timeoutSeconds=3600")
            resp = conn.getresponse()
            if resp.status != 200:
                resp.read()
                listing = self.call("GET", path)
                version = listing["metadata"]["resourceVersion"]
                continue
            while not stop.is_set():
                line = resp.readline()
                if not line:
                    break
                moment = time.monotonic()
                ev = json.loads(line)
                if ev["type"] == "ERROR":
                    listing = self.call("GET", path)
                    version = listing["metadata"]["resourceVersion"]
                    break
                version = ev["object"]["metadata"].get("resourceVersion", version)
                on_event(ev["type"], ev["object"], moment)
            conn.close()


class Tracker:
    """First moment each (kind, name, what) was seen; waits for them."""

    def __init__(self, namespace):
        self.namespace = namespace
        self.seen = {}
        self.pv_of = {}
        self.node_of = {}
        self.cond = threading.Condition()

    def mark(self, key, moment):
        with self.cond:
            if key not in self.seen:
                self.seen[key] = moment
                self.cond.notify_all()

    def pod(self, kind, obj, moment):
        name = obj["metadata"]["name"]
        if kind == "DELETED":
            self.mark(("pod", name, "gone"), moment)
            return
        node = obj["spec"].get("nodeName")
        if node:
            with self.cond:
                self.node_of[name] = node
            self.mark(("pod", name, "scheduled"), moment)
        for condition in pod_marks(obj):
            self.mark(("pod", name, condition), moment)
        phase = obj.get("status", {}).get("phase")
        if phase in ("Running", "Succeeded", "Failed"):
            self.mark(("pod", name, phase), moment)

    def pvc(self, kind, obj, moment):
        name = obj["metadata"]["name"]
        if kind == "DELETED":
            self.mark(("pvc", name, "gone"), moment)
            return
        for claim, what in pvc_marks(obj):
            if what == "Bound":
                with self.cond:
                    self.pv_of[claim] = obj["spec"].get("volumeName")
            self.mark(("pvc", claim, what), moment)

    def pv(self, kind, obj, moment):
        if kind == "DELETED":
            self.mark(("pv", obj["metadata"]["name"], "gone"), moment)
            return
        claim = pv_claim(obj, self.namespace)
        if claim:
            self.mark(("pvc", claim, "pv_added"), moment)

    def event(self, kind, obj, moment):
        if kind == "DELETED":
            return
        claim = provisioning_claim(obj, self.namespace)
        if claim:
            self.mark(("pvc", claim, "provisioning"), moment)

    def snapshot(self, kind, obj, moment):
        name = obj["metadata"]["name"]
        if kind == "DELETED":
            self.mark(("vs", name, "gone"), moment)
        elif obj.get("status", {}).get("readyToUse"):
            self.mark(("vs", name, "ready"), moment)

    def content(self, kind, obj, moment):
        if kind == "DELETED":
            ref = obj["spec"].get("volumeSnapshotRef", {}).get("name", "")
            self.mark(("vsc", ref, "gone"), moment)

    def wait(self, keys, timeout):
        end = time.monotonic() + timeout
        with self.cond:
            while True:
                missing = [k for k in keys if k not in self.seen]
                if not missing:
                    return [self.seen[k] for k in keys]
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"not seen within {timeout}s: {missing[:3]} ({len(missing)} in all)")
                self.cond.wait(min(left, 1.0))

    def settle(self, keys, timeout):
        """Waits up to timeout for keys that may never come (a moment the
        breakdown reads); returns a copy of every moment seen."""
        try:
            self.wait(keys, timeout)
        except TimeoutError:
            pass
        with self.cond:
            return dict(self.seen)


def percentile(samples, p):
    s = sorted(samples)
    if not s:
        return None
    rank = max(1, -(-len(s) * p // 100))
    return s[int(rank) - 1]


def summary(samples):
    if not samples:
        return {}
    return {"n": len(samples), "p50": percentile(samples, 50), "p95": percentile(samples, 95),
            "p99": percentile(samples, 99), "mean": statistics.fmean(samples), "max": max(samples)}


def serves(pod, nodes):
    """Whether a driver's pod serves a row whose claims' pods run on nodes:
    a pod of a DaemonSet on one of them, or any pod not of a DaemonSet (a
    controller, wherever it runs). An idle node's node plugin is left out,
    as it was when the benchmark had one node."""
    owners = pod["metadata"].get("ownerReferences") or []
    per_node = any(o.get("kind") == "DaemonSet" for o in owners)
    return not per_node or pod.get("spec", {}).get("nodeName") in nodes


class Containers:
    """CPU seconds and resident memory of a driver's containers, read from
    /proc through the cgroup each container runs in (cgroup v1, cgroupfs)."""

    def __init__(self, api, namespace, selector, driver_containers, nodes):
        self.api, self.namespace, self.selector = api, namespace, selector
        self.driver_containers = set(driver_containers)
        self.nodes = set(nodes)

    def ids(self):
        q = urllib.parse.quote(self.selector)
        pods = self.api.call("GET", f"/api/v1/namespaces/{self.namespace}/pods?labelSelector={q}")
        out = {}
        for p in pods["items"]:
            if not serves(p, self.nodes):
                continue
            for c in p.get("status", {}).get("containerStatuses", []):
                cid = c.get("containerID", "").split("://")[-1]
                if cid:
                    out[cid] = "driver" if c["name"] in self.driver_containers else "sidecars"
        return out

    def processes(self, ids):
        found = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/cgroup") as f:
                    cg = f.read()
            except OSError:
                continue
            for cid, group in ids.items():
                if cid in cg:
                    found.append((int(pid), group))
                    break
        return found

    @staticmethod
    def cpu_and_rss(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/statm") as f:
                rss = int(f.read().split()[1]) * PAGE
        except (OSError, IndexError, ValueError):
            return None
        return (int(fields[11]) + int(fields[12])) / CLK_TCK, rss

    def sample(self, procs):
        cpu = {"driver": 0.0, "sidecars": 0.0}
        rss = {"driver": 0, "sidecars": 0}
        for pid, group in procs:
            r = self.cpu_and_rss(pid)
            if r:
                cpu[group] += r[0]
                rss[group] += r[1]
        return cpu, rss


class Sampler(threading.Thread):
    """Samples a driver's containers every 0.25 s while a row runs."""

    def __init__(self, containers):
        super().__init__(daemon=True)
        self.containers = containers
        self.procs = containers.processes(containers.ids())
        self.first = containers.sample(self.procs)[0]
        self.peak = {"driver": 0, "sidecars": 0}
        self.stop = threading.Event()

    def run(self):
        while not self.stop.wait(0.25):
            _, rss = self.containers.sample(self.procs)
            for g in rss:
                self.peak[g] = max(self.peak[g], rss[g])

    def finish(self):
        self.stop.set()
        self.join()
        cpu, rss = self.containers.sample(self.procs)
        for g in rss:
            self.peak[g] = max(self.peak[g], rss[g])
        return {"cpu_seconds": {g: round(cpu[g] - self.first[g], 3) for g in cpu},
                "peak_rss_mib": {g: round(self.peak[g] / 2**20, 1) for g in self.peak}}


def metrics_texts(api, driver):
    """The /metrics text of each of the driver's pods (the drivers that
    export metrics); None for the others."""
    port = driver.get("metrics_port")
    if not port:
        return None
    q = urllib.parse.quote(driver["metrics_selector"])
    pods = api.call("GET", f"/api/v1/namespaces/{driver['pods_namespace']}/pods?labelSelector={q}")
    texts = []
    for p in pods["items"]:
        ip = p.get("status", {}).get("podIP")
        if not ip:
            continue
        try:
            conn = http.client.HTTPConnection(ip, port, timeout=10)
            conn.request("GET", "/metrics")
            texts.append(conn.getresponse().read().decode())
        except (OSError, http.client.HTTPException):
            continue  # a pod of the driver without a metrics listener
    return texts


def rpc_totals(api, driver):
    """The driver's RPC time and number of calls by method, summed over its
    pods ({"sum": {...}, "count": {...}}, parse_rpc); None for a driver
    without metrics. In the cluster flavor the router times CreateVolume
    (the hop to the node agent included; the agent's own port records no
    call) and each node's plugin its NodeStageVolume and NodePublishVolume."""
    texts = metrics_texts(api, driver)
    return None if texts is None else parse_rpc(texts)


class Bench:
    # how long the breakdown waits for the moments of a row's claims that
    # have not come yet (most often an Event) before it counts them missing
    SETTLE_SECONDS = 2.0

    def __init__(self, cfg, args):
        self.cfg, self.args = cfg, args
        self.api = Api(cfg["server"], cfg["ca"], cfg["cert"], cfg["key"])
        self.ns = cfg["namespace"]
        # the nodes of the rows over several nodes; the other rows' pods run
        # on cfg["node"]
        self.nodes = ([n.strip() for n in args.nodes.split(",") if n.strip()] if args.nodes
                      else cfg.get("nodes") or [cfg["node"]])
        self.track = Tracker(self.ns)
        self.stop = threading.Event()
        self.results = {d["name"]: {} for d in cfg["drivers"]}
        self.breakdowns = {d["name"]: {} for d in cfg["drivers"]}
        self.not_measured = {d["name"]: {} for d in cfg["drivers"]}
        self.serial = 0
        # only the Events the breakdown reads: a burst's pods make many more
        events = f"/api/v1/namespaces/{self.ns}/events?fieldSelector=" + urllib.parse.quote(
            "reason=Provisioning,involvedObject.kind=PersistentVolumeClaim")
        watches = [
            (f"/api/v1/namespaces/{self.ns}/pods", self.track.pod),
            (f"/api/v1/namespaces/{self.ns}/persistentvolumeclaims", self.track.pvc),
            ("/api/v1/persistentvolumes", self.track.pv),
            (events, self.track.event),
            (f"/apis/snapshot.storage.k8s.io/v1/namespaces/{self.ns}/volumesnapshots", self.track.snapshot),
            ("/apis/snapshot.storage.k8s.io/v1/volumesnapshotcontents", self.track.content),
        ]
        for path, fn in watches:
            threading.Thread(target=self.api.watch, args=(path, fn, self.stop), daemon=True).start()

    def name(self, prefix):
        self.serial += 1
        return f"{prefix}-{self.serial}"

    def add(self, driver, row, key, value):
        self.results[driver["name"]].setdefault(row, {}).setdefault(key, []).append(value)

    def row_breakdown(self, driver, row):
        return self.breakdowns[driver["name"]].setdefault(row, RowBreakdown())

    def add_phases(self, d, row, made):
        """Each claim's phases (made: {claim: the moment it and its pod, of
        the same name, were made}), added as phase_<name>. Waits a moment
        for moments a watch has not delivered yet (an Event is written
        after the call that caused it)."""
        keys = [(kind, c, what) for c in made for kind, what in (
            ("pvc", "selected_node"), ("pvc", "provisioning"), ("pvc", "pv_added"), ("pvc", "Bound"),
            ("pod", "scheduled"), ("pod", "PodReadyToStartContainers"))]
        seen = self.track.settle(keys, self.SETTLE_SECONDS)
        rows = self.row_breakdown(d, row)
        for c, t0 in made.items():
            moments, from_initialized = claim_moments(seen, c, c)
            for phase, seconds in rows.add_claim(c, t0, moments, from_initialized).items():
                if seconds is not None:
                    self.add(d, row, f"phase_{phase}", seconds)

    # objects --------------------------------------------------------------

    def claim(self, name, cls, size="1Gi", source=None):
        spec = {"accessModes": ["ReadWriteOnce"], "storageClassName": cls,
                "resources": {"requests": {"storage": size}}}
        if source:
            spec["dataSource"] = {"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": source}
        self.api.call("POST", f"/api/v1/namespaces/{self.ns}/persistentvolumeclaims",
                      {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                       "metadata": {"name": name, "labels": {"bench": "true"}}, "spec": spec})

    def pod(self, name, claim, command=None, restart="Always", node=None):
        # A shell that ends at once on SIGTERM; the host's network (no pod
        # address: bursts larger than the pod subnet fit, and the CNI's cost is
        # left out of every driver's figure alike).
        cmd = command or "trap 'exit 0' TERM; while :; do sleep 1; done"
        self.api.call("POST", f"/api/v1/namespaces/{self.ns}/pods", {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {"bench": "true"}},
            "spec": {
                "hostNetwork": True, "restartPolicy": restart, "terminationGracePeriodSeconds": 1,
                "nodeSelector": {"kubernetes.io/hostname": node or self.cfg["node"]},
                "containers": [{"name": "app", "image": self.cfg["image"], "imagePullPolicy": "Never",
                                "command": ["sh", "-c", cmd],
                                "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
                "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": claim}}]}})

    def delete(self, kind, name):
        path = {"pod": f"/api/v1/namespaces/{self.ns}/pods/{name}",
                "pvc": f"/api/v1/namespaces/{self.ns}/persistentvolumeclaims/{name}",
                "vs": f"/apis/snapshot.storage.k8s.io/v1/namespaces/{self.ns}/volumesnapshots/{name}"}[kind]
        self.api.call("DELETE", path, ok=(200, 202, 404))

    def pv_of(self, claim):
        with self.track.cond:
            return self.track.pv_of.get(claim)

    def registered_on(self, d, node):
        """Whether the kubelet of node lists the driver in its CSINode (true
        for a driver whose config names no csi_driver)."""
        if not d.get("csi_driver"):
            return True
        obj = self.api.call("GET", f"/apis/storage.k8s.io/v1/csinodes/{node}", ok=(200, 404))
        drivers = (obj or {}).get("spec", {}).get("drivers") or []
        return any(x.get("name") == d["csi_driver"] for x in drivers)

    # rows -----------------------------------------------------------------

    def single(self, d):
        c = self.name("s")
        before = rpc_totals(self.api, d)
        t0 = time.monotonic()
        self.claim(c, d["class"])
        self.pod(c, c)
        bound, sched, running = self.track.wait(
            [("pvc", c, "Bound"), ("pod", c, "scheduled"), ("pod", c, "Running")], 300)
        after = rpc_totals(self.api, d)
        self.add(d, "single", "claim_to_running", running - t0)
        if before is not None and after is not None:
            # the driver's own share: its CreateVolume, NodeStageVolume and
            # NodePublishVolume time, of the claim's whole way to Running
            spent = sum(after["sum"].get(m, 0) - before["sum"].get(m, 0) for m in CLAIM_RPCS)
            self.add(d, "single", "driver_seconds", spent)
            self.add(d, "single", "driver_share_pct", 100 * spent / (running - t0))
        self.add(d, "single", "claim_to_bound", bound - t0)
        self.add(d, "single", "bound_to_scheduled", max(0.0, sched - bound))
        self.add(d, "single", "scheduled_to_running", running - max(sched, bound))
        self.add_phases(d, "single", {c: t0})
        self.row_breakdown(d, "single").add_rpc(before, after)
        pv = self.pv_of(c)
        t1 = time.monotonic()
        self.delete("pod", c)
        (gone,) = self.track.wait([("pod", c, "gone")], 300)
        self.delete("pvc", c)
        (pv_gone,) = self.track.wait([("pv", pv, "gone")], 300)
        self.add(d, "single", "pod_delete_to_gone", gone - t1)
        self.add(d, "single", "delete_to_nothing_left", pv_gone - t1)

    def make_many(self, d, names, node_of=None):
        """Claims with a pod each, made at once (8 client threads), each pod
        on its node of node_of (cfg["node"] by default); the moment each was
        made."""
        made = {}
        node_of = node_of or {}

        def make(c):
            made[c] = time.monotonic()
            self.claim(c, d["class"])
            self.pod(c, c, node=node_of.get(c))

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(make, names))
        return made

    def delete_many(self, names):
        """Deletes the pods, then their claims; the time until every
        PersistentVolume is gone."""
        pvs = [self.pv_of(c) for c in names]
        t1 = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda c: self.delete("pod", c), names))
        self.track.wait([("pod", c, "gone") for c in names], 60 + 3 * len(names))
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda c: self.delete("pvc", c), names))
        gone = self.track.wait([("pv", pv, "gone") for pv in pvs], 60 + 3 * len(names))
        return max(gone) - t1

    def sampler(self, d, nodes):
        return Sampler(Containers(self.api, d["pods_namespace"], d["pods_selector"], d["driver_containers"], nodes))

    def burst(self, d, n, nodes=None):
        """N claims with a pod each, made at once; on several nodes, the
        pods go to each in turn."""
        nodes = nodes or [self.cfg["node"]]
        row = f"burst{n}" if len(nodes) == 1 else f"burst{n}-{len(nodes)}nodes"
        sampler = self.sampler(d, nodes)
        before = rpc_totals(self.api, d)
        names = [self.name(f"b{n}") for _ in range(n)]
        node_of = {c: nodes[i % len(nodes)] for i, c in enumerate(names)}
        sampler.start()
        t0 = time.monotonic()
        made = self.make_many(d, names, node_of)
        running = self.track.wait([("pod", c, "Running") for c in names], 60 + 3 * n)
        t_all = max(running) - t0
        cost = sampler.finish()
        after = rpc_totals(self.api, d)
        for c, r in zip(names, running):
            self.add(d, row, "claim_to_running", r - made[c])
        self.add(d, row, "all_running", t_all)
        self.add(d, row, "claims_per_minute", n / t_all * 60)
        for g in ("driver", "sidecars"):
            self.add(d, row, f"cpu_seconds_{g}", cost["cpu_seconds"][g])
            self.add(d, row, f"peak_rss_mib_{g}", cost["peak_rss_mib"][g])
        if before is not None and after is not None:
            spent = sum(after["sum"].get(m, 0) - before["sum"].get(m, 0) for m in CLAIM_RPCS)
            self.add(d, row, "driver_seconds_per_claim", spent / n)
        if len(nodes) > 1:
            # where the pods ran, as the API server says (not where they were sent)
            with self.track.cond:
                ran = [self.track.node_of.get(c) for c in names]
            for node in nodes:
                self.add(d, row, f"pods_on_{node}", ran.count(node))
        self.add_phases(d, row, made)
        self.row_breakdown(d, row).add_rpc(before, after)
        self.add(d, row, "delete_to_nothing_left", self.delete_many(names))

    def burst_nodes(self, d, n):
        """burst N spread evenly over self.nodes, or the reason it cannot
        be measured for this driver."""
        row = f"burst{n}-{max(2, len(self.nodes))}nodes"
        if len(self.nodes) < 2:
            self.not_measured[d["name"]][row] = "one node given (--nodes, or the config's nodes)"
            return
        absent = [node for node in self.nodes if not self.registered_on(d, node)]
        if absent:
            self.not_measured[d["name"]][row] = f"the driver is not registered on {', '.join(absent)} (CSINode)"
            log(f"{d['name']}: {row} not measured: {self.not_measured[d['name']][row]}")
            return
        self.burst(d, n, self.nodes)

    def hold(self, d, n, seconds):
        """N pods, each with its volume, running for SECONDS: what the
        kubelet's periodic calls (volume stats, capabilities) cost the driver
        and its sidecars, per minute."""
        row = f"hold{n}"
        names = [self.name(f"h{n}") for _ in range(n)]
        self.make_many(d, names)
        self.track.wait([("pod", c, "Running") for c in names], 60 + 3 * n)
        sampler = self.sampler(d, [self.cfg["node"]])
        before = rpc_totals(self.api, d)
        sampler.start()
        time.sleep(seconds)
        cost = sampler.finish()
        after = rpc_totals(self.api, d)
        per_minute = 60 / seconds
        for g in ("driver", "sidecars"):
            self.add(d, row, f"cpu_seconds_per_minute_{g}", cost["cpu_seconds"][g] * per_minute)
            self.add(d, row, f"peak_rss_mib_{g}", cost["peak_rss_mib"][g])
        if before is not None and after is not None:
            calls = after["count"].get("NodeGetVolumeStats", 0) - before["count"].get("NodeGetVolumeStats", 0)
            self.add(d, row, "volume_stats_calls_per_minute", calls * per_minute)
        self.delete_many(names)

    def snapshot(self, d, mib):
        src, vs, dst = self.name("src"), self.name("vs"), self.name("rst")
        size = f"{mib // 1024 + 2}Gi"
        self.claim(src, d["class"], size)
        self.pod(src, src, f"dd if=/dev/urandom of=/data/f bs=1M count={mib} conv=fsync 2>/dev/null", "Never")
        self.track.wait([("pod", src, "Succeeded")], 600)
        self.delete("pod", src)
        self.track.wait([("pod", src, "gone")], 120)
        t0 = time.monotonic()
        self.api.call("POST", f"/apis/snapshot.storage.k8s.io/v1/namespaces/{self.ns}/volumesnapshots", {
            "apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot",
            "metadata": {"name": vs, "labels": {"bench": "true"}},
            "spec": {"volumeSnapshotClassName": d["snapshot_class"],
                     "source": {"persistentVolumeClaimName": src}}})
        (ready,) = self.track.wait([("vs", vs, "ready")], 900)
        self.add(d, "snapshot", "snapshot_ready", ready - t0)
        t1 = time.monotonic()
        self.claim(dst, d["class"], size, source=vs)
        self.pod(dst, dst, f"test $(wc -c < /data/f) = {mib * 2**20} || exit 1; "
                 "trap 'exit 0' TERM; while :; do sleep 1; done")
        (running,) = self.track.wait([("pod", dst, "Running")], 900)
        self.add(d, "snapshot", "restore_to_running", running - t1)
        # the restored file has every byte: the pod's check would have ended
        # its container, and the kubelet would have started it again
        time.sleep(3)
        status = self.api.call("GET", f"/api/v1/namespaces/{self.ns}/pods/{dst}")["status"]
        app = status.get("containerStatuses", [{}])[0]
        if app.get("restartCount", 1) != 0 or "running" not in app.get("state", {}):
            raise RuntimeError(f"{d['name']}: the restored claim {dst} lacks data ({app})")
        pvs = [self.pv_of(src), self.pv_of(dst)]
        self.delete("pod", dst)
        self.track.wait([("pod", dst, "gone")], 300)
        for c in (src, dst):
            self.delete("pvc", c)
        self.delete("vs", vs)
        self.track.wait([("pv", pv, "gone") for pv in pvs] + [("vsc", vs, "gone")], 600)

    def run(self):
        a = self.args
        rows = a.rows.split(",")
        bursts = [int(b) for b in a.bursts.split(",") if b]
        drivers = self.cfg["drivers"]
        for r in range(a.rounds):
            order = drivers if r % 2 == 0 else list(reversed(drivers))
            for d in order:
                log(f"round {r + 1}/{a.rounds}: {d['name']}")
                if "single" in rows:
                    for _ in range(a.singles):
                        self.single(d)
                if "burst" in rows:
                    for n in bursts:
                        self.burst(d, n)
                if "burst2n" in rows:
                    for n in bursts:
                        self.burst_nodes(d, n)
                if "hold" in rows:
                    self.hold(d, a.hold_pods, a.hold_seconds)
                if "snapshot" in rows:
                    self.snapshot(d, a.snapshot_mib)
        self.stop.set()

    def report(self, out):
        os.makedirs(out, exist_ok=True)
        summ = {drv: {row: {k: summary(v) for k, v in keys.items()} for row, keys in rows.items()}
                for drv, rows in self.results.items()}
        broken = {drv: {row: b.report() for row, b in rows.items()} for drv, rows in self.breakdowns.items()}
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump({"summary": summ, "samples": self.results, "breakdown": broken,
                       "not_measured": self.not_measured, "nodes": self.nodes, "args": vars(self.args)},
                      f, indent=1)
        text = figures_table(summ)
        for row in ordered_union(broken):
            text += "\n" + median_table(row, {drv: rows[row] for drv, rows in broken.items() if row in rows})
        gaps = [f"- {row}, {drv}: not measured: {why}" for drv, rows in self.not_measured.items()
                for row, why in rows.items()]
        if gaps:
            text += "\n" + "\n".join(gaps) + "\n"
        with open(os.path.join(out, "results.md"), "w") as f:
            f.write(text)
        print(text)


def ordered_union(by_driver):
    """The keys of every driver's dict, in the order first seen."""
    out = {}
    for rows in by_driver.values():
        for row in rows:
            out.setdefault(row, None)
    return list(out)


def figures_table(summ):
    """results.md's table: each row's figures, p50 / p95 / p99 where there
    are more than two samples, a column a driver."""
    lines = ["| row | figure | " + " | ".join(summ) + " |",
             "|---|---|" + "---|" * len(summ)]
    for row in ordered_union(summ):
        for key in ordered_union({drv: rows.get(row, {}) for drv, rows in summ.items()}):
            cells = []
            for drv in summ:
                s = summ[drv].get(row, {}).get(key)
                if not s:
                    cells.append("-")
                elif s["n"] > 2:
                    cells.append(f"{s['p50']:.3g} / {s['p95']:.3g} / {s['p99']:.3g}")
                else:
                    cells.append(f"{s['p50']:.3g}")
            lines.append(f"| {row} | {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--singles", type=int, default=10)
    p.add_argument("--bursts", default="50,200")
    p.add_argument("--snapshot-mib", type=int, default=1024)
    p.add_argument("--hold-pods", type=int, default=100)
    p.add_argument("--hold-seconds", type=int, default=180)
    p.add_argument("--rows", default="single,burst,burst2n,snapshot,hold")
    p.add_argument("--nodes", default="",
                   help="comma-separated node names the burst2n rows spread their pods over; "
                        "the config's nodes when empty")
    p.add_argument("--drivers", default="",
                   help="comma-separated names (or their beginnings) of the config's drivers to measure; all when empty")
    args = p.parse_args()
    with open(args.config) as f:
        cfg = json.load(f)
    if args.drivers:
        wanted = [w.strip() for w in args.drivers.split(",") if w.strip()]
        cfg["drivers"] = [d for d in cfg["drivers"] if any(d["name"].startswith(w) for w in wanted)]
        if not cfg["drivers"]:
            p.error(f"--drivers {args.drivers!r} names none of the config's drivers")
    bench = Bench(cfg, args)
    try:
        bench.run()
    finally:
        bench.report(args.out)


if __name__ == "__main__":
    main()
