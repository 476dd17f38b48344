#!/usr/bin/env python3
"""Where the CPU of some processes goes, thread by thread, while they work.

    scripts/thread-cpu.py [--until FILE] NAME=PID [NAME=PID ...]

It stops once FILE exists, or at SIGTERM or SIGINT (a signal that comes
before Python has started ends it without a report: a caller that cannot wait
for that should use --until).

Samples every thread's CPU time (user + system, from /proc/PID/task/TID/stat)
and the machine's busy time (/proc/stat) every 20 ms. At the stop it prints,
for each thread that ran, its CPU seconds over the whole time and in its
busiest second, then how many cores the machine kept busy in its busiest
second (or on average over a shorter run). A stage that holds a pipeline
back shows as one thread near a whole core; work spread over threads that
together fill the cores shows none.
A thread that waits on the disk instead shows in how many of its samples it
was in uninterruptible sleep (state D), and the machine's in the share of the
time some task stalled on I/O (/proc/pressure/io, where the kernel has it).
The sampling itself costs a little CPU: figures taken beside it are not the
benchmark's.
"""

import os
import signal
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")
WINDOW = 1.0
stop = False


def ask_stop(*_):
    global stop
    stop = True


def threads(pid):
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                st = f.read()
        except OSError:
            continue
        name = st[st.index("(") + 1 : st.rindex(")")]
        fields = st[st.rindex(")") + 2 :].split()
        yield tid, name, int(fields[11]) + int(fields[12]), fields[0]


def io_stalled():
    """Microseconds some task and all tasks stalled on I/O, or None."""
    try:
        with open("/proc/pressure/io") as f:
            lines = f.read().split("\n")
    except OSError:
        return None
    totals = [int(w.split("=")[1]) for ln in lines for w in ln.split() if w.startswith("total=")]
    return totals if len(totals) == 2 else None


def machine_busy():
    with open("/proc/stat") as f:
        c = [int(x) for x in f.readline().split()[1:]]
    return sum(c) - c[3] - c[4]


def busiest(samples):
    """The most ticks between two samples at most WINDOW apart."""
    best, j = 0, 0
    for i in range(len(samples)):
        while samples[i][0] - samples[j][0] > WINDOW:
            j += 1
        best = max(best, samples[i][1] - samples[j][1])
    return best


def main():
    args = sys.argv[1:]
    until = None
    if args[:1] == ["--until"] and len(args) > 1:
        until, args = args[1], args[2:]
    procs = [a.split("=", 1) for a in args]
    if not procs or any(len(p) != 2 for p in procs):
        sys.exit(__doc__)
    signal.signal(signal.SIGTERM, ask_stop)
    signal.signal(signal.SIGINT, ask_stop)
    seen = {}
    waits = {}
    machine = []
    stalled = io_stalled()
    while not stop and not (until and os.path.exists(until)):
        now = time.monotonic()
        machine.append((now, machine_busy()))
        for name, pid in procs:
            for tid, comm, ticks, state in threads(pid):
                seen.setdefault((name, tid, comm), []).append((now, ticks))
                waits[(name, tid, comm)] = waits.get((name, tid, comm), 0) + (state == "D")
        time.sleep(0.02)
    rows = []
    for key, s in seen.items():
        total = s[-1][1] - s[0][1]
        if total > 0:
            rows.append((busiest(s), total, len(s), key))
    rows.sort(reverse=True)
    for best, total, samples, (name, tid, comm) in rows:
        print(
            f"{name:10} {tid:>7} {comm:18} {total / TICK:6.2f} s in all, "
            f"{best / TICK:5.2f} s in its busiest second, waiting on I/O "
            f"in {waits.get((name, tid, comm), 0)} of {samples} samples"
        )
    after = io_stalled()
    if len(machine) < 2:
        return
    span = machine[-1][0] - machine[0][0]
    # Over a shorter time than a second, the busiest second is all of it.
    print(
        f"machine: {busiest(machine) / TICK / min(span, WINDOW):.2f} cores busy "
        f"in its busiest second ({len(machine)} samples over {span:.2f} s)"
    )
    if stalled and after:
        # /proc/pressure/io counts microseconds.
        some, full = ((b - a) / (span * 1e6) * 100 for a, b in zip(stalled, after))
        print(
            f"machine: some task stalled on I/O {some:.0f}% of the time, "
            f"all tasks {full:.0f}%"
        )


if __name__ == "__main__":
    main()
