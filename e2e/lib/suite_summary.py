#!/usr/bin/env python3
"""Summary of a ginkgo JSON report of the External Storage suite.

Counts only the specs of the driver's External Storage tests (the rest of the
e2e binary is filtered out), splits the skipped ones into those this runner
skipped by e2e/skips.md and those the suite skipped itself (with its reason,
grouped), and lists every failure with the first line of its message.

usage: suite_summary.py REPORT.json SECONDS [SKIPS.md]
"""

import collections
import json
import re
import sys

FOCUS = re.compile(r"External.Storage \[Driver: example\.csi\.k8s\.io\]")


def full_text(spec):
    return " ".join(spec.get("ContainerHierarchyTexts") or []) + " " + spec.get("LeafNodeText", "")


def main():
    report_path, took = sys.argv[1], sys.argv[2]
    with open(report_path) as f:
        reports = json.load(f)
    counts = collections.Counter()
    reasons = collections.Counter()
    failures = []
    for report in reports:
        for spec in report.get("SpecReports") or []:
            if spec.get("LeafNodeType") != "It":
                continue
            name = full_text(spec)
            if not FOCUS.search(name):
                continue
            state = spec.get("State")
            message = ((spec.get("Failure") or {}).get("Message") or "").strip()
            if state == "passed":
                counts["passed"] += 1
            elif state == "skipped":
                if "nterrupted" in message or "imeout" in message:
                    counts["timed out"] += 1
                elif message:
                    counts["skipped by the suite"] += 1
                    reasons[message.splitlines()[0][:160]] += 1
                else:
                    counts["skipped by e2e/skips.md"] += 1
            elif state == "pending":
                counts["pending"] += 1
            else:
                counts["failed"] += 1
                first = message.splitlines()[0][:200] if message else state
                failures.append(f"{name.strip()}\n      {state}: {first}")
    print(f"passed: {counts['passed']}")
    print(f"failed: {counts['failed']}")
    print(f"skipped by the suite: {counts['skipped by the suite']}")
    print(f"skipped by e2e/skips.md: {counts['skipped by e2e/skips.md']}")
    print(f"pending: {counts['pending']}")
    print(f"not run, the run's time ran out: {counts['timed out']}")
    print(f"time: {took}s")
    if failures:
        print("failures:")
        for f in sorted(failures):
            print(f"  - {f}")
    if reasons:
        print("the suite's own skip reasons (count, reason):")
        for reason, n in reasons.most_common():
            print(f"  {n:5d}  {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
