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
    let goals = if two {
        goals(&meds[0], &meds[1])
    } else {
        Vec::new()
    };
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
        let _ = writeln!(text, "\ngoals (A = {}, B = {}):", names[0], names[1]);
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

/// The goals the comparison checks (speed at scale, O(1) snapshots and restores,
/// node latency, memory, startup), A being our driver and B the reference.
fn goals(a: &Medians, b: &Medians) -> Vec<Goal> {
    let mut out = volume_goals(a, b);
    out.extend(node_goals(a, b));
    out
}

/// Speed at scale, and snapshots and restores in constant time.
fn volume_goals(a: &Medians, b: &Medians) -> Vec<Goal> {
    let both = |k: &str| Some((*a.get(k)?, *b.get(k)?));
    let ours = |k1: &str, k2: &str| Some((*a.get(k1)?, *a.get(k2)?));
    let mut out = vec![
        check(
            "CreateVolume p50 with 5000 present <= 1/3 of the reference's",
            both("scale/5000/create_p50_ms"),
            |x, y| x <= y / 3.0,
            |x, y| format!("{x:.2} ms vs {y:.2} ms (A/B = {:.3})", x / y),
        ),
        check(
            "our CreateVolume p50 at 10000 <= 1.5x at 0",
            ours("scale/10000/create_p50_ms", "scale/0/create_p50_ms"),
            |x, y| x <= 1.5 * y,
            |x, y| format!("{x:.2} ms vs {y:.2} ms ({:.2}x)", x / y),
        ),
    ];
    for op in ["create_snapshot", "restore"] {
        out.push(check(
            &format!("{op} of 1 GiB >= 100x faster than the reference"),
            both(&format!("snapshot/1GiB/{op}_ms")),
            |x, y| x * 100.0 <= y,
            |x, y| format!("{x:.2} ms vs {y:.1} ms ({:.0}x)", y / x),
        ));
    }
    for (what, op) in [
        ("CreateSnapshot", "create_snapshot"),
        ("restore", "restore"),
    ] {
        out.push(check(
            &format!("our {what} at 4 GiB within 2x of at 100 MiB"),
            ours(
                &format!("snapshot/4GiB/{op}_ms"),
                &format!("snapshot/100MiB/{op}_ms"),
            ),
            |x, y| x <= 2.0 * y,
            |x, y| format!("{x:.2} ms vs {y:.2} ms ({:.2}x)", x / y),
        ));
    }
    out
}

/// Node latency, memory and startup.
fn node_goals(a: &Medians, b: &Medians) -> Vec<Goal> {
    let both = |k: &str| Some((*a.get(k)?, *b.get(k)?));
    let mut out = Vec::new();
    for m in ["stage_publish", "unpublish_unstage"] {
        out.push(check(
            &format!("dir {m} p50 faster than the reference's"),
            both(&format!("node/dir/{m}_p50_ms")),
            |x, y| x < y,
            |x, y| format!("{x:.2} ms vs {y:.2} ms"),
        ));
        out.push(check(
            &format!("image {m} p50 under 60 ms"),
            a.get(&format!("node/image/{m}_p50_ms")).map(|x| (*x, 60.0)),
            |x, y| x < y,
            |x, _| format!("{x:.2} ms"),
        ));
    }
    for n in ["0", "5000"] {
        out.push(check(
            &format!("RSS with {n} volumes below the reference's"),
            both(&format!("memory/{n}/rss_mib")),
            |x, y| x < y,
            |x, y| format!("{x:.1} MiB vs {y:.1} MiB"),
        ));
    }
    out.push(check(
        "startup to ready with 10000 volumes under 1 s",
        a.get("startup/10000/ready_ms").map(|x| (*x, 1000.0)),
        |x, y| x < y,
        |x, _| format!("{x:.0} ms"),
    ));
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

    #[test]
    fn goals_compare_ours_with_the_reference() {
        let a: Medians = [("scale/5000/create_p50_ms".to_string(), 1.0)].into();
        let b: Medians = [("scale/5000/create_p50_ms".to_string(), 4.0)].into();
        let g = goals(&a, &b);
        assert_eq!(g[0].verdict, "met");
        assert_eq!(g[1].verdict, "not measured");
        let svg = crate::svg::scale(&["a".into(), "b".into()], &[a, b]).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("polyline"));
    }
}
