//! Medians over rounds, the B/A ratio, the goals of the comparison, and the
//! output files: results.json, results.txt, scale.svg, snapshot.svg.

use std::collections::BTreeMap;
use std::fmt::Write;

use serde_json::json;

use crate::scenarios::Figures;
use crate::svg;
use crate::Args;

/// key -> values over rounds, in the order the keys first appeared.
pub fn by_key(rounds: &[Figures]) -> Vec<(String, Vec<f64>)> {
    let mut order: Vec<String> = Vec::new();
    let mut map: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for r in rounds {
        for (k, v) in &r.0 {
            if !map.contains_key(k) {
                order.push(k.clone());
            }
            map.entry(k.clone()).or_default().push(*v);
        }
    }
    order
        .into_iter()
        .map(|k| {
            let v = map.remove(&k).unwrap_or_default();
            (k, v)
        })
        .collect()
}

pub fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

pub type Medians = BTreeMap<String, f64>;

fn medians(rounds: &[Figures]) -> Medians {
    by_key(rounds)
        .into_iter()
        .map(|(k, v)| (k, median(&v)))
        .collect()
}

pub fn write(args: &Args, names: &[String], results: &[Vec<Figures>]) -> Result<(), String> {
    let meds: Vec<Medians> = results.iter().map(|r| medians(r)).collect();
    let keys = by_key(&results.concat());
    let two = names.len() > 1;
    let goals = goals(&meds[0], meds.get(1).unwrap_or(&Medians::new()));
    let text = table(names, results, &meds, &keys, &goals);
    let json = json!({
        "generated_unix": std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        "command": std::env::args().collect::<Vec<_>>(),
        "machine": machine(),
        "drivers": names.iter().enumerate().map(|(i, n)| json!({
            "name": n,
            "rounds": results[i].iter().map(|r| r.0.iter().map(|(k, v)| (k.clone(), json!(v))).collect::<serde_json::Map<_, _>>()).collect::<Vec<_>>(),
            "medians": meds[i],
        })).collect::<Vec<_>>(),
        "ratio_b_over_a": if two {
            json!(keys.iter().filter_map(|(k, _)| Some((k.clone(), json!(meds[1].get(k)? / meds[0].get(k)?)))).collect::<serde_json::Map<_, _>>())
        } else { json!(null) },
        "goals": goals.iter().map(|g| json!({"goal": g.goal, "verdict": g.verdict, "detail": g.detail})).collect::<Vec<_>>(),
    });
    let put = |name: &str, body: String| {
        std::fs::write(args.out.join(name), body)
            .map_err(|e| format!("{}: {e}", args.out.join(name).display()))
    };
    put("results.txt", text)?;
    put(
        "results.json",
        serde_json::to_string_pretty(&json).unwrap_or_default(),
    )?;
    if let Some(s) = svg::scale(names, &meds) {
        put("scale.svg", s)?;
    }
    if let Some(s) = svg::snapshot(names, &meds) {
        put("snapshot.svg", s)?;
    }
    Ok(())
}

/// results.txt: a line a figure, with both drivers' medians and their ratio
/// (or one driver's median and its rounds), then the goals.
fn table(
    names: &[String],
    results: &[Vec<Figures>],
    meds: &[Medians],
    keys: &[(String, Vec<f64>)],
    goals: &[Goal],
) -> String {
    let mut text = String::new();
    let _ = writeln!(
        text,
        "csi-bench: {} round(s) per driver; medians",
        results.iter().map(|r| r.len()).max().unwrap_or(0)
    );
    let two = names.len() > 1;
    if two {
        let _ = writeln!(
            text,
            "{:<48} {:>12} {:>12} {:>9}",
            "figure", names[0], names[1], "B/A"
        );
    } else {
        let _ = writeln!(text, "{:<48} {:>12}  rounds", "figure", names[0]);
    }
    for (k, _) in keys {
        let a = meds[0].get(k).copied().unwrap_or(f64::NAN);
        if two {
            let b = meds[1].get(k).copied().unwrap_or(f64::NAN);
            let _ = writeln!(
                text,
                "{k:<48} {:>12} {:>12} {:>9}",
                num(a),
                num(b),
                num(b / a)
            );
        } else {
            let per: Vec<String> = by_key(&results[0])
                .into_iter()
                .find(|(x, _)| x == k)
                .map(|(_, v)| v.iter().map(|x| num(*x)).collect())
                .unwrap_or_default();
            let _ = writeln!(text, "{k:<48} {:>12}  {}", num(a), per.join(" "));
        }
    }
    if !goals.is_empty() {
        let reference = names.get(1).map_or("not measured", String::as_str);
        let _ = writeln!(text, "\ngoals (A = {}, B = {reference}):", names[0]);
        for g in goals {
            let _ = writeln!(text, "  [{}] {}: {}", g.verdict, g.goal, g.detail);
        }
    }
    text
}

fn num(x: f64) -> String {
    if x.is_nan() || x.is_infinite() {
        "-".into()
    } else if x.abs() >= 100.0 {
        format!("{x:.0}")
    } else if x.abs() >= 1.0 {
        format!("{x:.2}")
    } else {
        format!("{x:.3}")
    }
}

fn machine() -> serde_json::Value {
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mem = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .next()
        .unwrap_or_default()
        .to_string();
    json!({
        "nproc": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "memory": mem,
        "kernel": kernel.trim(),
    })
}

pub struct Goal {
    pub goal: String,
    pub verdict: &'static str,
    pub detail: String,
}

/// A goal met or missed by the figures `vals` (`ok`, described by `show`), or
/// not measured when they are missing.
fn check(
    goal: &str,
    vals: Option<(f64, f64)>,
    ok: impl Fn(f64, f64) -> bool,
    show: impl Fn(f64, f64) -> String,
) -> Goal {
    match vals {
        Some((x, y)) => Goal {
            goal: goal.into(),
            verdict: if ok(x, y) { "met" } else { "MISSED" },
            detail: show(x, y),
        },
        None => Goal {
            goal: goal.into(),
            verdict: "not measured",
            detail: String::new(),
        },
    }
}

/// The goals the figures are checked against, A being our driver and B the
/// reference (empty when A was measured alone: the goals against it are then
/// not measured).
fn goals(a: &Medians, b: &Medians) -> Vec<Goal> {
    let mut out = volume_goals(a, b);
    out.extend(scale_goals(a, b));
    out.extend(node_goals(a, b));
    out.extend(snapshot_goals(a));
    out
}

fn both<'a>(a: &'a Medians, b: &'a Medians) -> impl Fn(&str) -> Option<(f64, f64)> + 'a {
    move |k| Some((*a.get(k)?, *b.get(k)?))
}

/// Our figure `key` under a fixed `bound`, shown in `unit`.
fn below(a: &Medians, goal: &str, key: &str, bound: f64, unit: &str) -> Goal {
    check(
        goal,
        a.get(key).map(|x| (*x, bound)),
        |x, y| x < y,
        |x, _| format!("{x:.2} {unit}"),
    )
}

/// Our figure `key` at most `factor` times our figure `base`.
fn within(a: &Medians, goal: &str, key: &str, base: &str, factor: f64) -> Goal {
    check(
        goal,
        a.get(key).zip(a.get(base)).map(|(x, y)| (*x, *y)),
        |x, y| x <= factor * y,
        |x, y| format!("{x:.2} ms vs {y:.2} ms ({:.2}x)", x / y),
    )
}

fn ms_vs(x: f64, y: f64) -> String {
    format!("{x:.2} ms vs {y:.2} ms (A/B = {:.3})", x / y)
}

/// Everyday volume operations against the reference: no slower with none
/// present, half its latency from 2,000 up, three times its throughput with
/// many clients.
fn volume_goals(a: &Medians, b: &Medians) -> Vec<Goal> {
    let both = both(a, b);
    let mut out = Vec::new();
    for (op, name) in [("create", "CreateVolume"), ("delete", "DeleteVolume")] {
        out.push(check(
            &format!("{name} p50 with 0 present <= the reference's"),
            both(&format!("scale/0/{op}_p50_ms")),
            |x, y| x <= y,
            ms_vs,
        ));
        out.push(check(
            &format!("{name} p50 with 2000 present <= 1/2 of the reference's"),
            both(&format!("scale/2000/{op}_p50_ms")),
            |x, y| x <= y / 2.0,
            ms_vs,
        ));
    }
    for c in [16, 64] {
        out.push(check(
            &format!("CreateVolume ops/s with {c} clients >= 3x the reference's"),
            both(&format!("create-delete/c{c}/create_ops_s")),
            |x, y| x >= 3.0 * y,
            |x, y| format!("{x:.0} vs {y:.0} ops/s ({:.2}x)", x / y),
        ));
    }
    out
}

/// Start-up, and 100,000 volumes: latency, memory, listing.
fn scale_goals(a: &Medians, b: &Medians) -> Vec<Goal> {
    vec![
        below(
            a,
            "startup to ready with 10000 volumes under 60 ms",
            "startup/10000/ready_ms",
            60.0,
            "ms",
        ),
        check(
            "startup to ready with 10000 volumes below the reference's",
            both(a, b)("startup/10000/ready_ms"),
            |x, y| x < y,
            ms_vs,
        ),
        below(
            a,
            "startup to ready with 100000 volumes under 500 ms",
            "startup/100000/ready_ms",
            500.0,
            "ms",
        ),
        within(
            a,
            "our CreateVolume p50 at 100000 within 1.5x of at 0",
            "scale/100000/create_p50_ms",
            "scale/0/create_p50_ms",
            1.5,
        ),
        below(
            a,
            "RSS with 100000 volumes under 64 MiB",
            "memory/100000/rss_mib",
            64.0,
            "MiB",
        ),
        below(
            a,
            "ListVolumes of all pages with 100000 volumes under 1 s",
            "scale/100000/list_all_ms",
            1000.0,
            "ms",
        ),
    ]
}

/// Stage and publish of a new image volume with a filesystem, and their undoing.
fn node_goals(a: &Medians, b: &Medians) -> Vec<Goal> {
    let both = both(a, b);
    let mut out = vec![below(
        a,
        "image stage_publish p50 under 15 ms",
        "node/image/stage_publish_p50_ms",
        15.0,
        "ms",
    )];
    for kind in ["image", "dir"] {
        out.push(check(
            &format!("{kind} unpublish_unstage p50 below the reference's"),
            both(&format!("node/{kind}/unpublish_unstage_p50_ms")),
            |x, y| x < y,
            ms_vs,
        ));
    }
    out
}

/// CreateSnapshot of a published volume (its freeze included) and a restore
/// from it, fast at every size and constant in the data's size.
fn snapshot_goals(a: &Medians) -> Vec<Goal> {
    let mut sizes: Vec<(f64, String)> = a
        .keys()
        .filter_map(|k| {
            let label = k
                .strip_prefix("snapshot/")?
                .strip_suffix("/create_snapshot_ms")?;
            Some((crate::svg::mib(label)?, label.to_string()))
        })
        .collect();
    sizes.sort_by(|x, y| x.0.total_cmp(&y.0));
    let mut out = Vec::new();
    for (op, name, bound) in [
        ("create_snapshot", "CreateSnapshot", 20.0),
        ("restore", "restore", 10.0),
    ] {
        for (_, label) in &sizes {
            out.push(below(
                a,
                &format!("{name} of {label} under {bound:.0} ms"),
                &format!("snapshot/{label}/{op}_ms"),
                bound,
                "ms",
            ));
        }
        if let (Some((_, small)), Some((_, large))) = (sizes.first(), sizes.last()) {
            if small != large {
                out.push(within(
                    a,
                    &format!("{name} of {large} within 2x of {small}"),
                    &format!("snapshot/{large}/{op}_ms"),
                    &format!("snapshot/{small}/{op}_ms"),
                    2.0,
                ));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scenarios::percentile;
    use std::time::Duration;

    #[test]
    fn median_of_odd_and_even_rounds() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn nearest_rank_percentiles() {
        let s: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(percentile(&s, 0.50), Duration::from_millis(50));
        assert_eq!(percentile(&s, 0.99), Duration::from_millis(99));
        assert_eq!(percentile(&s[..1], 0.95), Duration::from_millis(1));
    }

    fn verdict<'a>(goals: &'a [Goal], goal: &str) -> &'a str {
        goals
            .iter()
            .find(|g| g.goal == goal)
            .unwrap_or_else(|| panic!("no goal {goal:?}"))
            .verdict
    }

    fn medians(pairs: &[(&str, f64)]) -> Medians {
        pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
    }

    #[test]
    fn goals_compare_ours_with_the_reference() {
        let a = medians(&[
            ("scale/0/create_p50_ms", 1.0),
            ("scale/2000/create_p50_ms", 1.0),
            ("scale/100000/create_p50_ms", 1.6),
            ("create-delete/c16/create_ops_s", 2000.0),
        ]);
        let b = medians(&[
            ("scale/0/create_p50_ms", 0.9),
            ("scale/2000/create_p50_ms", 2.0),
            ("create-delete/c16/create_ops_s", 600.0),
        ]);
        let g = goals(&a, &b);
        let v = |goal: &str| verdict(&g, goal);
        assert_eq!(
            v("CreateVolume p50 with 0 present <= the reference's"),
            "MISSED"
        );
        assert_eq!(
            v("CreateVolume p50 with 2000 present <= 1/2 of the reference's"),
            "met"
        );
        assert_eq!(
            v("CreateVolume ops/s with 16 clients >= 3x the reference's"),
            "met"
        );
        assert_eq!(
            v("our CreateVolume p50 at 100000 within 1.5x of at 0"),
            "MISSED"
        );
        assert_eq!(
            v("DeleteVolume p50 with 0 present <= the reference's"),
            "not measured"
        );
        let svg = crate::svg::scale(&["a".into(), "b".into()], &[a, b]).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("polyline"));
    }

    #[test]
    fn goals_of_one_driver_need_no_reference() {
        let a = medians(&[
            ("startup/10000/ready_ms", 59.0),
            ("startup/100000/ready_ms", 501.0),
            ("memory/100000/rss_mib", 40.0),
            ("scale/100000/list_all_ms", 300.0),
            ("snapshot/100MiB/create_snapshot_ms", 10.0),
            ("snapshot/16GiB/create_snapshot_ms", 25.0),
            ("snapshot/100MiB/restore_ms", 2.0),
            ("snapshot/16GiB/restore_ms", 3.0),
        ]);
        let g = goals(&a, &Medians::new());
        let v = |goal: &str| verdict(&g, goal);
        assert_eq!(v("startup to ready with 10000 volumes under 60 ms"), "met");
        assert_eq!(
            v("startup to ready with 100000 volumes under 500 ms"),
            "MISSED"
        );
        assert_eq!(
            v("startup to ready with 10000 volumes below the reference's"),
            "not measured"
        );
        assert_eq!(v("RSS with 100000 volumes under 64 MiB"), "met");
        assert_eq!(
            v("ListVolumes of all pages with 100000 volumes under 1 s"),
            "met"
        );
        assert_eq!(v("CreateSnapshot of 100MiB under 20 ms"), "met");
        assert_eq!(v("CreateSnapshot of 16GiB under 20 ms"), "MISSED");
        assert_eq!(v("CreateSnapshot of 16GiB within 2x of 100MiB"), "MISSED");
        assert_eq!(v("restore of 16GiB within 2x of 100MiB"), "met");
        assert_eq!(v("image stage_publish p50 under 15 ms"), "not measured");
    }
}
