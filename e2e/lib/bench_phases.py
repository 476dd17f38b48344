"""Where a claim's time goes on its way to a running pod, for the cluster
benchmark (e2e/lib/bench_cluster.py), and the driver's own calls beside it.

Each moment is the client's monotonic clock when a watch delivered the
change, never a timestamp the objects carry (an Event's are whole seconds),
so the breakdown reads alike for every driver. Nothing here talks to the API
server: the functions take what the watches saw, so that they can be tested
with made-up moments (e2e/lib/test_bench_cluster.py).
"""

import re

# The moments of a claim's way, in order, each with the phase that ends at it
# (the first phase starts when the claim and its pod are made).
STEPS = (
    # the PVC's volume.kubernetes.io/selected-node annotation: the
    # scheduler's first pass chose a node (WaitForFirstConsumer)
    ("selected_node", "schedule_node"),
    # the first Provisioning Event about the claim: external-provisioner
    # took it up
    ("provisioning", "provisioner_queue"),
    # a PersistentVolume whose claimRef names the claim (CreateVolume done)
    ("pv_added", "provision"),
    ("bound", "bind"),
    # the pod's spec.nodeName
    ("pod_on_node", "schedule_pod"),
    # the pod's PodReadyToStartContainers condition True: the kubelet mounted
    # the volume (NodeStageVolume, NodePublishVolume) and made the sandbox
    ("sandbox", "mount"),
    ("running", "start"),
)
MOMENTS = tuple(m for m, _ in STEPS)
PHASES = tuple(p for _, p in STEPS)

SELECTED_NODE = "volume.kubernetes.io/selected-node"

# The calls of a claim's way that are the driver's own work: CreateVolume
# within provision, NodeStageVolume and NodePublishVolume within mount.
CLAIM_RPCS = ("CreateVolume", "NodeStageVolume", "NodePublishVolume")


# What a watched object says ---------------------------------------------------

def pvc_marks(obj):
    """The moments a PersistentVolumeClaim shows: (claim, what)."""
    name = obj["metadata"]["name"]
    out = []
    if SELECTED_NODE in (obj["metadata"].get("annotations") or {}):
        out.append((name, "selected_node"))
    if obj.get("status", {}).get("phase") == "Bound":
        out.append((name, "Bound"))
    return out


def pv_claim(obj, namespace):
    """The claim a PersistentVolume was made for, if it is one of
    namespace's; None otherwise."""
    ref = obj.get("spec", {}).get("claimRef") or {}
    if ref.get("namespace") == namespace and ref.get("name"):
        return ref["name"]
    return None


def provisioning_claim(event, namespace):
    """The claim a core v1 Event says external-provisioner started on
    (reason Provisioning), if it is one of namespace's; None otherwise."""
    about = event.get("involvedObject") or {}
    if (event.get("reason") == "Provisioning" and about.get("kind") == "PersistentVolumeClaim"
            and about.get("namespace", namespace) == namespace):
        return about.get("name")
    return None


def pod_marks(obj):
    """The moments a pod's status shows: the names of its conditions that
    are True, among those the breakdown reads."""
    out = []
    for c in obj.get("status", {}).get("conditions") or []:
        if c.get("status") == "True" and c.get("type") in ("PodReadyToStartContainers", "Initialized"):
            out.append(c["type"])
    return out


# A claim's breakdown ----------------------------------------------------------

def claim_moments(seen, claim, pod):
    """The moments of STEPS for one claim and its pod, from the tracker's
    first-seen moments (None where a watch never showed it), and whether
    the sandbox moment is the Initialized condition's.

    Kubernetes v1.37 (e2e/versions.sh) always reports PodReadyToStartContainers
    (GA there). A kubelet without it (before v1.29, or with its gate off)
    leaves only Initialized, which for a pod with no init containers turns
    True with the kubelet's first status of it, before the volume is
    mounted: mount then reads about 0 and start holds the mount. Such claims
    are counted, not hidden."""
    m = {
        "selected_node": seen.get(("pvc", claim, "selected_node")),
        "provisioning": seen.get(("pvc", claim, "provisioning")),
        "pv_added": seen.get(("pvc", claim, "pv_added")),
        "bound": seen.get(("pvc", claim, "Bound")),
        "pod_on_node": seen.get(("pod", pod, "scheduled")),
        "sandbox": seen.get(("pod", pod, "PodReadyToStartContainers")),
        "running": seen.get(("pod", pod, "Running")),
    }
    from_initialized = False
    if m["sandbox"] is None and seen.get(("pod", pod, "Initialized")) is not None:
        m["sandbox"] = seen[("pod", pod, "Initialized")]
        from_initialized = True
    return m, from_initialized


def breakdown(start, moments):
    """The phases of one claim's way from start (claim and pod made) to its
    pod Running, in seconds: {phase: seconds or None}, the moments missing,
    and the moments seen before the one they follow.

    A moment seen earlier than the one before it (two watches deliver in
    their own order: an Event can come after the PersistentVolume it
    preceded) counts as that one: its phase is 0, and the next phase starts
    from the later moment, so the phases still add up to start -> the last
    moment. A missing moment leaves both phases around it unknown (None)
    rather than folding one into the other; the phases after it go on from
    the last moment seen."""
    phases, missing, early = {}, [], []
    last, known = start, True
    for moment, phase in STEPS:
        t = moments.get(moment)
        if t is None:
            missing.append(moment)
            phases[phase] = None
            known = False
            continue
        if t < last:
            early.append(moment)
            t = last
        phases[phase] = t - last if known else None
        last, known = t, True
    return phases, missing, early


def median_claim(claims):
    """The claim whose claim-to-Running is the median of claims (a list of
    dicts with "claim_to_running"), by the same rank as the p50 of the
    summaries; None for none."""
    if not claims:
        return None
    ranked = sorted(claims, key=lambda c: c["claim_to_running"])
    rank = max(1, -(-len(ranked) * 50 // 100))
    return ranked[rank - 1]


class RowBreakdown:
    """The breakdowns of one row's claims for one driver, over every round:
    each claim's phases, how many lacked each moment or saw it early, and
    the driver's call time over the row."""

    def __init__(self):
        self.claims = []
        self.missing = {m: 0 for m in MOMENTS}
        self.early = {m: 0 for m in MOMENTS}
        self.sandbox_from_initialized = 0
        self.rpc = {m: {"sum": 0.0, "count": 0.0} for m in CLAIM_RPCS}

    def add_claim(self, claim, start, moments, from_initialized=False):
        """Records one claim; returns its phases."""
        phases, missing, early = breakdown(start, moments)
        for m in missing:
            self.missing[m] += 1
        for m in early:
            self.early[m] += 1
        if from_initialized:
            self.sandbox_from_initialized += 1
        running = moments.get("running")
        self.claims.append({"claim": claim,
                            "claim_to_running": None if running is None else running - start,
                            "phases": phases})
        return phases

    def add_rpc(self, before, after):
        """The driver's calls between two scrapes (rpc_totals), or nothing
        for a driver without metrics."""
        if before is None or after is None:
            return
        for what in ("sum", "count"):
            for m in CLAIM_RPCS:
                self.rpc[m][what] += after[what].get(m, 0) - before[what].get(m, 0)

    def rpc_per_call(self):
        """Mean seconds per call of each of CLAIM_RPCS over the row (sum
        delta / count delta); None where the driver made no such call or
        exports no metrics."""
        return {m: (v["sum"] / v["count"] if v["count"] > 0 else None) for m, v in self.rpc.items()}

    def report(self):
        timed = [c for c in self.claims if c["claim_to_running"] is not None]
        return {"median_claim": median_claim(timed),
                "claims": len(self.claims),
                "missing_moments": self.missing,
                "early_moments": self.early,
                "sandbox_from_initialized": self.sandbox_from_initialized,
                "rpc_per_call_seconds": self.rpc_per_call(),
                "per_claim": self.claims}


# The driver's own calls ---------------------------------------------------------

RPC_LINE = re.compile(r'^example_csi_rpc_duration_seconds_(sum|count)\{[^}]*method="(\w+)"[^}]*\} (\S+)$', re.M)


def parse_rpc(texts):
    """{"sum": {method: seconds}, "count": {method: calls}} summed over the
    /metrics texts of a driver's pods."""
    total = {"sum": {}, "count": {}}
    for text in texts:
        for what, method, value in RPC_LINE.findall(text):
            total[what][method] = total[what].get(method, 0.0) + float(value)
    return total


# The report ----------------------------------------------------------------------

def fmt(seconds):
    return "-" if seconds is None else f"{seconds:.3g}"


def median_table(row, by_driver):
    """results.md's table of one row's median claim: its phases for each
    driver, and beside them the driver's mean time per call. by_driver:
    {driver: RowBreakdown.report()}."""
    drivers = list(by_driver)
    lines = [f"Median claim of {row} (seconds; the claim whose claim-to-Running is the median):", "",
             "| phase | " + " | ".join(drivers) + " |", "|---|" + "---:|" * len(drivers)]

    def line(label, cell):
        lines.append(f"| {label} | " + " | ".join(cell(by_driver[d]) for d in drivers) + " |")

    def phase_of(p):
        return lambda r: fmt(r["median_claim"]["phases"][p]) if r["median_claim"] else "-"

    line("claim", lambda r: r["median_claim"]["claim"] if r["median_claim"] else "-")
    for p in PHASES:
        line(p, phase_of(p))
    line("claim_to_running", lambda r: fmt(r["median_claim"]["claim_to_running"]) if r["median_claim"] else "-")
    for m, within in (("CreateVolume", "provision"), ("NodeStageVolume", "mount"), ("NodePublishVolume", "mount")):
        line(f"{m}, mean per call over the row (within {within})",
             lambda r, m=m: fmt(r["rpc_per_call_seconds"][m]))
    notes = []
    for d in drivers:
        r = by_driver[d]
        gaps = [f"{m} {n}" for m, n in r["missing_moments"].items() if n]
        early = [f"{m} {n}" for m, n in r["early_moments"].items() if n]
        if gaps:
            notes.append(f"{d}: claims without a moment (phases around it left out): "
                         f"{', '.join(gaps)} of {r['claims']}")
        if early:
            notes.append(f"{d}: moments seen before the one they follow (phase counted 0): {', '.join(early)}")
        if r["sandbox_from_initialized"]:
            notes.append(f"{d}: claims whose mount ends at Initialized (no PodReadyToStartContainers): "
                         f"{r['sandbox_from_initialized']} of {r['claims']}")
    if notes:
        lines.append("")
        lines.extend(f"- {n}" for n in notes)
    return "\n".join(lines) + "\n"
