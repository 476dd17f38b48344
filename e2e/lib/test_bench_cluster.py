"""The cluster benchmark's breakdown of a claim's way, from made-up watch
events: no cluster needed.

    python3 -m unittest discover -s e2e/lib -p 'test_*.py'
"""

import argparse
import contextlib
import io
import json
import os
import tempfile
import threading
import time
import unittest

from bench_cluster import Bench, Tracker, figures_table, serves
from bench_phases import (PHASES, RowBreakdown, breakdown, claim_moments, median_claim, median_table,
                          parse_rpc)

NS = "bench"


def pvc(name, selected=None, phase="Pending", volume=None):
    meta = {"name": name, "namespace": NS}
    if selected:
        meta["annotations"] = {"volume.kubernetes.io/selected-node": selected}
    return {"metadata": meta, "spec": {"volumeName": volume}, "status": {"phase": phase}}


def pv(name, claim, namespace=NS):
    return {"metadata": {"name": name},
            "spec": {"claimRef": {"kind": "PersistentVolumeClaim", "namespace": namespace, "name": claim}}}


def event(claim, reason="Provisioning", kind="PersistentVolumeClaim", count=1):
    return {"metadata": {"name": f"{claim}.17f", "namespace": NS}, "reason": reason, "count": count,
            "involvedObject": {"kind": kind, "namespace": NS, "name": claim}}


def pod(name, node=None, phase="Pending", conditions=()):
    return {"metadata": {"name": name, "namespace": NS}, "spec": {"nodeName": node} if node else {},
            "status": {"phase": phase, "conditions": [{"type": t, "status": s} for t, s in conditions]}}


# A claim's way with every moment, in order: made at 10.0, Running at 11.5.
IN_ORDER = {"selected_node": 10.1, "provisioning": 10.15, "pv_added": 10.25, "bound": 10.3,
            "pod_on_node": 11.0, "sandbox": 11.4, "running": 11.5}


class Breakdown(unittest.TestCase):
    def test_phases_in_order_add_up_to_claim_to_running(self):
        phases, missing, early = breakdown(10.0, IN_ORDER)
        want = {"schedule_node": 0.1, "provisioner_queue": 0.05, "provision": 0.1, "bind": 0.05,
                "schedule_pod": 0.7, "mount": 0.4, "start": 0.1}
        for p in PHASES:
            self.assertAlmostEqual(phases[p], want[p], places=9, msg=p)
        self.assertAlmostEqual(sum(phases.values()), 1.5)
        self.assertEqual((missing, early), ([], []))

    def test_an_event_seen_after_the_volume_counts_the_provision_as_zero(self):
        late = dict(IN_ORDER, provisioning=10.4)
        phases, missing, early = breakdown(10.0, late)
        self.assertAlmostEqual(phases["provisioner_queue"], 0.3)
        self.assertEqual(phases["provision"], 0)
        self.assertEqual(phases["bind"], 0)
        self.assertAlmostEqual(phases["schedule_pod"], 0.6)
        self.assertEqual(early, ["pv_added", "bound"])
        self.assertEqual(missing, [])
        # still the whole way: nothing counted twice, nothing negative
        self.assertAlmostEqual(sum(phases.values()), 1.5)
        self.assertTrue(all(v >= 0 for v in phases.values()))

    def test_a_missing_event_leaves_both_phases_around_it_unknown(self):
        phases, missing, early = breakdown(10.0, dict(IN_ORDER, provisioning=None))
        self.assertIsNone(phases["provisioner_queue"])
        self.assertIsNone(phases["provision"])
        self.assertAlmostEqual(phases["schedule_node"], 0.1)
        self.assertAlmostEqual(phases["bind"], 0.05)
        self.assertEqual(missing, ["provisioning"])
        self.assertEqual(early, [])

    def test_a_missing_first_moment_and_a_missing_last_do_not_crash(self):
        phases, missing, _ = breakdown(10.0, {"pv_added": 10.2, "bound": 10.3})
        self.assertEqual(missing, ["selected_node", "provisioning", "pod_on_node", "sandbox", "running"])
        self.assertAlmostEqual(phases["bind"], 0.1)
        self.assertEqual([p for p in PHASES if phases[p] is not None], ["bind"])

    def test_nothing_seen_at_all(self):
        phases, missing, _ = breakdown(10.0, {})
        self.assertEqual(set(phases.values()), {None})
        self.assertEqual(len(missing), len(PHASES))


class Watches(unittest.TestCase):
    """The tracker fed as the watches would feed it, then read by the breakdown."""

    def feed(self, track):
        track.pvc("ADDED", pvc("c-1"), 10.0)
        track.pvc("MODIFIED", pvc("c-1", selected="node2"), 10.1)
        track.event("ADDED", event("c-1"), 10.15)
        # the same Event again (its count raised) and events of other kinds
        track.event("MODIFIED", event("c-1", count=2), 10.9)
        track.event("ADDED", event("c-1", reason="ExternalProvisioning"), 10.05)
        track.event("ADDED", event("c-1", kind="Pod"), 10.06)
        # a claim of the same name in another namespace
        track.pv("ADDED", pv("pvc-other", "c-1", namespace="elsewhere"), 10.2)
        track.pv("ADDED", pv("pvc-1", "c-1"), 10.25)
        track.pv("MODIFIED", pv("pvc-1", "c-1"), 10.35)
        track.pvc("MODIFIED", pvc("c-1", selected="node2", phase="Bound", volume="pvc-1"), 10.3)
        track.pod("ADDED", pod("c-1"), 10.0)
        track.pod("MODIFIED", pod("c-1", node="node2"), 11.0)
        track.pod("MODIFIED", pod("c-1", node="node2", conditions=[
            ("PodReadyToStartContainers", "False"), ("Initialized", "True")]), 11.1)
        track.pod("MODIFIED", pod("c-1", node="node2", conditions=[
            ("PodReadyToStartContainers", "True"), ("Initialized", "True")]), 11.4)
        track.pod("MODIFIED", pod("c-1", node="node2", phase="Running", conditions=[
            ("PodReadyToStartContainers", "True"), ("Initialized", "True")]), 11.5)

    def test_the_first_delivery_of_each_moment_is_the_one_read(self):
        track = Tracker(NS)
        self.feed(track)
        moments, from_initialized = claim_moments(track.seen, "c-1", "c-1")
        self.assertEqual(moments, IN_ORDER)
        self.assertFalse(from_initialized)
        self.assertEqual(track.pv_of["c-1"], "pvc-1")
        self.assertEqual(track.node_of["c-1"], "node2")

    def test_without_the_sandbox_condition_mount_ends_at_initialized(self):
        track = Tracker(NS)
        track.pod("MODIFIED", pod("c-2", node="n", conditions=[("Initialized", "True")]), 11.1)
        track.pod("MODIFIED", pod("c-2", node="n", phase="Running",
                                  conditions=[("Initialized", "True")]), 11.5)
        moments, from_initialized = claim_moments(track.seen, "c-2", "c-2")
        self.assertEqual(moments["sandbox"], 11.1)
        self.assertTrue(from_initialized)

    def test_settle_returns_what_was_seen_when_a_moment_never_comes(self):
        track = Tracker(NS)
        self.feed(track)
        seen = track.settle([("pvc", "c-1", "provisioning"), ("pvc", "never", "provisioning")], 0.05)
        self.assertEqual(seen[("pvc", "c-1", "provisioning")], 10.15)


class Rows(unittest.TestCase):
    def row(self):
        r = RowBreakdown()
        for i, total in enumerate([3.0, 1.0, 2.0, 5.0, 4.0]):
            moments = {m: 10.0 + total * (k + 1) / 7 for k, m in enumerate(
                ["selected_node", "provisioning", "pv_added", "bound", "pod_on_node", "sandbox", "running"])}
            if i == 1:
                moments["provisioning"] = None
            if i == 2:
                moments["provisioning"] = moments["bound"] + 0.01
            r.add_claim(f"c-{i}", 10.0, moments, from_initialized=(i == 4))
        return r

    def test_counts_and_the_median_claim(self):
        rep = self.row().report()
        self.assertEqual(rep["claims"], 5)
        self.assertEqual(rep["missing_moments"]["provisioning"], 1)
        self.assertEqual(rep["early_moments"]["pv_added"], 1)
        self.assertEqual(rep["sandbox_from_initialized"], 1)
        self.assertEqual(rep["median_claim"]["claim"], "c-0")
        self.assertAlmostEqual(rep["median_claim"]["claim_to_running"], 3.0)

    def test_median_claim_takes_the_lower_middle_of_an_even_count(self):
        claims = [{"claim": c, "claim_to_running": t} for c, t in (("a", 4), ("b", 1), ("c", 3), ("d", 2))]
        self.assertEqual(median_claim(claims)["claim"], "d")
        self.assertIsNone(median_claim([]))

    def test_a_claim_never_running_is_kept_out_of_the_median(self):
        r = RowBreakdown()
        r.add_claim("gone", 10.0, {"selected_node": 10.1})
        r.add_claim("ran", 10.0, IN_ORDER)
        rep = r.report()
        self.assertEqual(rep["median_claim"]["claim"], "ran")
        self.assertEqual(rep["missing_moments"]["running"], 1)

    def test_the_median_table_shows_gaps_as_dashes(self):
        rows = {"ours": self.row().report(), "reference": RowBreakdown().report()}
        text = median_table("burst50", rows)
        self.assertIn("| schedule_node |", text)
        self.assertIn("| claim | c-0 | - |", text)
        self.assertIn("CreateVolume, mean per call over the row (within provision) | - | - |", text)
        self.assertIn("ours: claims without a moment", text)


class DriverCalls(unittest.TestCase):
    ROUTER = ('example_csi_rpc_duration_seconds_sum{service="Controller",method="CreateVolume"} 0.5\n'
              'example_csi_rpc_duration_seconds_count{service="Controller",method="CreateVolume"} 10\n'
              'example_csi_rpc_duration_seconds_bucket{service="Controller",method="CreateVolume",le="0.001"} 0\n')
    NODE = ('example_csi_rpc_duration_seconds_sum{service="Node",method="NodeStageVolume"} 0.2\n'
            'example_csi_rpc_duration_seconds_count{service="Node",method="NodeStageVolume"} 4\n'
            'example_csi_rpc_duration_seconds_sum{service="Node",method="NodePublishVolume"} 0.04\n'
            'example_csi_rpc_duration_seconds_count{service="Node",method="NodePublishVolume"} 4\n')

    def test_pods_are_summed(self):
        t = parse_rpc([self.ROUTER, self.NODE, self.NODE])
        self.assertEqual(t["sum"]["CreateVolume"], 0.5)
        self.assertEqual(t["count"]["NodeStageVolume"], 8)
        self.assertAlmostEqual(t["sum"]["NodePublishVolume"], 0.08)

    def test_mean_per_call_over_the_row(self):
        r = RowBreakdown()
        before = parse_rpc([self.ROUTER, self.NODE])
        mid = parse_rpc([self.ROUTER.replace("0.5", "0.8").replace("} 10", "} 13"), self.NODE])
        after = parse_rpc([self.ROUTER.replace("0.5", "1.1").replace("} 10", "} 16"),
                           self.NODE.replace("} 0.2", "} 0.5").replace("NodeStageVolume\"} 4", "NodeStageVolume\"} 7")])
        r.add_rpc(before, mid)
        r.add_rpc(mid, after)
        per_call = r.rpc_per_call()
        self.assertAlmostEqual(per_call["CreateVolume"], 0.6 / 6)
        self.assertAlmostEqual(per_call["NodeStageVolume"], 0.3 / 3)
        self.assertIsNone(per_call["NodePublishVolume"])

    def test_a_driver_without_metrics(self):
        r = RowBreakdown()
        r.add_rpc(None, None)
        self.assertEqual(set(r.rpc_per_call().values()), {None})


class Report(unittest.TestCase):
    def test_a_row_one_driver_lacks_still_shows(self):
        s = {"n": 1, "p50": 1.0, "p95": 1.0, "p99": 1.0}
        summ = {"a": {"single": {"claim_to_running": s}},
                "b": {"single": {"claim_to_running": s}, "burst50-2nodes": {"pods_on_node2": s}}}
        text = figures_table(summ)
        self.assertIn("| burst50-2nodes | pods_on_node2 | - | 1 |", text)

    def test_the_report_holds_the_breakdown_and_what_was_not_measured(self):
        bench = Bench.__new__(Bench)  # no API server: only what report reads
        bench.args = argparse.Namespace(rounds=1)
        bench.nodes = ["localhost", "node2"]
        bench.results = {"ours": {}, "reference": {}}
        bench.breakdowns = {"ours": {"single": RowBreakdown()}, "reference": {}}
        bench.not_measured = {"ours": {}, "reference": {"burst50-2nodes": "not registered on node2"}}
        bench.add({"name": "ours"}, "single", "claim_to_running", 1.5)
        bench.breakdowns["ours"]["single"].add_claim("s-1", 10.0, IN_ORDER)
        with tempfile.TemporaryDirectory() as out:
            with contextlib.redirect_stdout(io.StringIO()):
                bench.report(out)
            with open(os.path.join(out, "results.md")) as f:
                md = f.read()
            with open(os.path.join(out, "results.json")) as f:
                js = json.load(f)
        self.assertIn("Median claim of single", md)
        self.assertIn("burst50-2nodes, reference: not measured: not registered on node2", md)
        self.assertEqual(js["breakdown"]["ours"]["single"]["median_claim"]["claim"], "s-1")
        self.assertEqual(js["summary"]["ours"]["single"]["claim_to_running"]["p50"], 1.5)

    def test_an_idle_nodes_node_plugin_is_not_the_rows(self):
        def p(node, kind):
            return {"metadata": {"ownerReferences": [{"kind": kind}]}, "spec": {"nodeName": node}}
        self.assertTrue(serves(p("localhost", "DaemonSet"), {"localhost"}))
        self.assertFalse(serves(p("node2", "DaemonSet"), {"localhost"}))
        self.assertTrue(serves(p("node2", "ReplicaSet"), {"localhost"}))


class FakeApi:
    """An API server that answers at once and has the watches deliver a
    claim's whole way as soon as its pod is made: on the node named in the
    pod's nodeSelector, its Provisioning Event after its PersistentVolume
    for every third claim, none for the fifth."""

    def __init__(self, track, registered):
        self.track, self.registered = track, registered
        self.made = 0
        self.lock = threading.Lock()

    def call(self, method, path, body=None, ok=None):
        if method == "GET" and "/csinodes/" in path:
            node = path.rsplit("/", 1)[1]
            return {"kind": "CSINode", "spec": {"drivers": [{"name": n} for n in self.registered.get(node, [])]}}
        if method == "GET":
            return {"items": []}
        name = path.rsplit("/", 1)[1]
        if method == "POST" and path.endswith("/pods"):
            with self.lock:
                self.made += 1
                i = self.made
            self.deliver(body["metadata"]["name"], body["spec"]["nodeSelector"]["kubernetes.io/hostname"], i)
        elif method == "DELETE" and "/pods/" in path:
            self.track.pod("DELETED", pod(name), time.monotonic())
        elif method == "DELETE" and "/persistentvolumeclaims/" in path:
            self.track.pvc("DELETED", pvc(name), time.monotonic())
            self.track.pv("DELETED", pv(f"pvc-{name}", name), time.monotonic())
        return {}

    def deliver(self, c, node, i):
        t = self.track
        now = time.monotonic
        t.pvc("MODIFIED", pvc(c, selected=node), now())
        if i % 3 != 0 and i % 5 != 0:
            t.event("ADDED", event(c), now())
        t.pv("ADDED", pv(f"pvc-{c}", c), now())
        if i % 3 == 0 and i % 5 != 0:
            t.event("ADDED", event(c), now())
        t.pvc("MODIFIED", pvc(c, selected=node, phase="Bound", volume=f"pvc-{c}"), now())
        t.pod("MODIFIED", pod(c, node=node), now())
        t.pod("MODIFIED", pod(c, node=node, phase="Running", conditions=[
            ("PodReadyToStartContainers", "True"), ("Initialized", "True")]), now())


class RowsAgainstAFakeApi(unittest.TestCase):
    DRIVER = {"name": "ours", "csi_driver": "ours.csi", "class": "c", "pods_namespace": "d",
              "pods_selector": "x=y", "driver_containers": ["csi-driver"]}

    def bench(self, nodes, registered):
        b = Bench.__new__(Bench)  # no watches: the fake API server feeds the tracker
        b.cfg = {"node": nodes[0], "image": "busybox", "drivers": [self.DRIVER]}
        b.args = argparse.Namespace(rounds=1)
        b.ns, b.nodes, b.serial = NS, nodes, 0
        b.SETTLE_SECONDS = 0.01
        b.track = Tracker(NS)
        b.api = FakeApi(b.track, registered)
        b.results, b.breakdowns, b.not_measured = {"ours": {}}, {"ours": {}}, {"ours": {}}
        return b

    def test_single_and_bursts_break_down_every_claim(self):
        b = self.bench(["a", "b"], {"a": ["ours.csi"], "b": ["ours.csi"]})
        b.single(self.DRIVER)
        b.burst(self.DRIVER, 6)
        b.burst_nodes(self.DRIVER, 6)
        res = b.results["ours"]
        self.assertEqual(len(res["burst6"]["phase_mount"]), 6)
        self.assertEqual(len(res["single"]["phase_bind"]), 1)
        self.assertEqual(res["burst6-2nodes"]["pods_on_a"], [3])
        self.assertEqual(res["burst6-2nodes"]["pods_on_b"], [3])
        self.assertNotIn("pods_on_a", res["burst6"])
        rep = b.breakdowns["ours"]["burst6-2nodes"].report()
        self.assertEqual(rep["claims"], 6)
        self.assertGreaterEqual(rep["missing_moments"]["provisioning"], 1)
        self.assertGreaterEqual(rep["early_moments"]["pv_added"], 1)
        self.assertEqual(b.not_measured["ours"], {})

    def test_a_driver_missing_on_a_node_is_not_measured_there(self):
        b = self.bench(["a", "b"], {"a": ["ours.csi"]})
        with contextlib.redirect_stderr(io.StringIO()):
            b.burst_nodes(self.DRIVER, 4)
        self.assertIn("not registered on b", b.not_measured["ours"]["burst4-2nodes"])
        self.assertEqual(b.results["ours"], {})

    def test_one_node_only(self):
        b = self.bench(["a"], {"a": ["ours.csi"]})
        b.burst_nodes(self.DRIVER, 4)
        self.assertIn("one node", b.not_measured["ours"]["burst4-2nodes"])


if __name__ == "__main__":
    unittest.main()
