//! The README quick start, as written: `csi-driver client` creates, stages,
//! publishes, writes to, snapshots, restores and deletes a volume by hand.

mod common;

use std::path::Path;
use std::process::Command;

use common::{loops_below, mounts_below, require_root, Driver, Pool};

struct Out {
    ok: bool,
    stdout: String,
    stderr: String,
}

fn client(d: &Driver, args: &[&str]) -> Out {
    let out = Command::new(env!("CARGO_BIN_EXE_csi-driver"))
        .arg("client")
        .arg(format!("--endpoint=unix://{}", d.socket.display()))
        .args(args)
        .output()
        .expect("run csi-driver client");
    Out {
        ok: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn ok(d: &Driver, args: &[&str]) -> String {
    let o = client(d, args);
    assert!(o.ok, "client {args:?} failed: {}", o.stderr);
    o.stdout
}

/// The value of `key:` in the client's YAML output.
fn field(yaml: &str, key: &str) -> String {
    yaml.lines()
        .find_map(|l| {
            l.trim()
                .trim_start_matches("- ")
                .strip_prefix(&format!("{key}: "))
        })
        .unwrap_or_else(|| panic!("no {key} in:\n{yaml}"))
        .trim_matches('"')
        .to_string()
}

#[test]
#[ignore = "needs root: loop devices and mounts"]
fn root_client_quick_start() {
    require_root();
    let pool = Pool::new("xfs");
    let d = Driver::start(&pool, &[]);
    let staging = pool.scratch("staging");
    let target = pool.scratch("target");
    let (s, t) = (staging.to_str().unwrap(), target.to_str().unwrap());

    let info = ok(&d, &["info"]);
    assert!(info.contains("name: example.csi.k8s.io"), "{info}");
    assert!(info.contains("ready: true"), "{info}");
    let caps = ok(&d, &["capabilities"]);
    assert!(
        caps.contains("CREATE_DELETE_SNAPSHOT") && caps.contains("STAGE_UNSTAGE_VOLUME"),
        "{caps}"
    );

    let created = ok(
        &d,
        &["create-volume", "pvc-1", "--size", "1Gi", "--fs", "xfs"],
    );
    let vol = field(&created, "volume_id");
    assert_eq!(field(&created, "capacity_bytes"), (1u64 << 30).to_string());
    // The same name again is the same volume.
    assert_eq!(
        field(
            &ok(
                &d,
                &["create-volume", "pvc-1", "--size", "1Gi", "--fs", "xfs"]
            ),
            "volume_id"
        ),
        vol
    );
    assert!(ok(&d, &["list-volumes"]).contains(&vol));

    ok(&d, &["node-stage", &vol, "--staging", s, "--fs", "xfs"]);
    ok(
        &d,
        &[
            "node-publish",
            &vol,
            "--staging",
            s,
            "--target",
            t,
            "--fs",
            "xfs",
        ],
    );
    std::fs::write(target.join("hello.txt"), "hello from the quick start\n").unwrap();
    let stats = ok(&d, &["stats", &vol, "--path", t]);
    assert!(stats.contains("unit: BYTES"), "{stats}");

    let snap_out = ok(&d, &["create-snapshot", "snap-1", "--volume", &vol]);
    let snap = field(&snap_out, "snapshot_id");
    assert_eq!(field(&snap_out, "ready_to_use"), "true");
    let listed = ok(&d, &["-o", "json", "list-snapshots", "--volume", &vol]);
    let v: serde_json::Value = serde_json::from_str(&listed).expect("-o json prints JSON");
    assert_eq!(v["snapshots"][0]["snapshot_id"], snap.as_str());

    // A restore holds what was written before the snapshot.
    let restored = field(
        &ok(
            &d,
            &[
                "create-volume",
                "pvc-2",
                "--size",
                "1Gi",
                "--fs",
                "xfs",
                "--source-snapshot",
                &snap,
            ],
        ),
        "volume_id",
    );
    let staging2 = pool.scratch("staging2");
    let target2 = pool.scratch("target2");
    let (s2, t2) = (staging2.to_str().unwrap(), target2.to_str().unwrap());
    ok(
        &d,
        &["node-stage", &restored, "--staging", s2, "--fs", "xfs"],
    );
    ok(
        &d,
        &[
            "node-publish",
            &restored,
            "--staging",
            s2,
            "--target",
            t2,
            "--fs",
            "xfs",
            "--readonly",
        ],
    );
    assert_eq!(
        std::fs::read_to_string(target2.join("hello.txt")).unwrap(),
        "hello from the quick start\n"
    );
    ok(&d, &["node-unpublish", &restored, "--target", t2]);
    ok(&d, &["node-unstage", &restored, "--staging", s2]);
    ok(&d, &["delete-volume", &restored]);

    ok(&d, &["node-unpublish", &vol, "--target", t]);
    ok(&d, &["node-unstage", &vol, "--staging", s]);
    ok(&d, &["delete-snapshot", &snap]);
    ok(&d, &["delete-volume", &vol]);
    assert!(!ok(&d, &["list-volumes"]).contains(&vol));
    assert!(mounts_below(Path::new(&staging)).is_empty());
    assert!(
        loops_below(&pool.path).is_empty(),
        "{:?}",
        loops_below(&pool.path)
    );
}

#[test]
#[ignore = "needs root: loop devices and mounts"]
fn root_client_errors_print_the_grpc_code_and_fail() {
    require_root();
    let pool = Pool::new("xfs");
    let d = Driver::start(&pool, &[]);
    let o = client(
        &d,
        &["create-snapshot", "snap-x", "--volume", "no-such-volume"],
    );
    assert!(!o.ok);
    assert!(o.stderr.contains("NotFound"), "{}", o.stderr);
    let o = client(&d, &["create-volume", "", "--size", "1Gi"]);
    assert!(!o.ok);
    assert!(o.stderr.contains("InvalidArgument"), "{}", o.stderr);
    let o = client(&d, &["create-volume", "pvc-1", "--size", "1Zi"]);
    assert!(!o.ok, "a bad size is refused before any call");
    // Nothing was made by the failed calls.
    assert!(ok(&d, &["list-volumes"]).contains("volumes: []"));
}

#[test]
fn client_connection_error_is_one_sentence_with_endpoint_and_cause() {
    // No socket there: no driver (nor root) is needed to see the error.
    let o = Command::new(env!("CARGO_BIN_EXE_csi-driver"))
        .args(["client", "--endpoint=unix:///nonexistent/csi.sock", "info"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(o.stdout.is_empty());
    assert_eq!(
        String::from_utf8_lossy(&o.stderr),
        "csi-driver client: cannot connect to unix:///nonexistent/csi.sock: \
         no such file or directory\n"
    );
}

#[test]
#[ignore = "needs root: loop devices and mounts"]
fn root_client_output_flag_after_the_call_and_a_closed_pipe() {
    require_root();
    let pool = Pool::new("xfs");
    let d = Driver::start(&pool, &[]);
    ok(&d, &["create-volume", "pvc-1", "--size", "64Mi"]);
    // -o before the call's name and after it (the kubectl habit) alike.
    for args in [
        &["-o", "json", "list-volumes"][..],
        &["list-volumes", "-o", "json"],
        &["list-volumes", "--output=json"],
    ] {
        let out = ok(&d, args);
        let v: serde_json::Value = serde_json::from_str(&out)
            .unwrap_or_else(|e| panic!("{args:?} printed no JSON ({e}):\n{out}"));
        assert_eq!(
            v["volumes"].as_array().map(Vec::len),
            Some(1),
            "{args:?}: {out}"
        );
    }
    assert!(ok(&d, &["list-volumes", "-o", "yaml"]).starts_with("volumes:"));
    let bad = client(&d, &["list-volumes", "-o", "xml"]);
    assert!(!bad.ok && bad.stderr.contains("xml"), "{}", bad.stderr);

    // A reader that has gone before the answer is written (`| head -1` that has
    // read its line): the write fails with EPIPE, and the client ends quietly.
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let o = Command::new(env!("CARGO_BIN_EXE_csi-driver"))
        .arg("client")
        .arg(format!("--endpoint=unix://{}", d.socket.display()))
        .args(["list-volumes", "-o", "json"])
        .stdout(writer)
        .stderr(std::process::Stdio::piped())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(stderr.is_empty(), "nothing on stderr: {stderr}");
    assert_eq!(o.status.code(), Some(0), "{stderr}");
}

/// The quick start block of README.md (or of docs/benchmark.md, its source before
/// it is pasted), run by bash as written, against a driver on a test pool. Only the
/// fixed /tmp/csi folder of its staging and target paths is moved into the test's
/// scratch (the test's driver allows its own directory as the README's allows /tmp/csi).
#[test]
#[ignore = "needs root: loop devices and mounts"]
fn root_readme_quick_start_runs_as_written() {
    require_root();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let marker = "```sh\ncsi-driver client info\n";
    let text = ["README.md", "docs/benchmark.md"]
        .iter()
        .filter_map(|f| std::fs::read_to_string(root.join(f)).ok())
        .find(|t| t.contains(marker))
        .expect("a quick start block in README.md or docs/benchmark.md");
    let start = text.find(marker).unwrap() + "```sh\n".len();
    let block = &text[start..start + text[start..].find("```").unwrap()];

    let pool = Pool::new("xfs");
    let d = Driver::start(&pool, &[]);
    let scratch = pool.scratch("quick-start");
    let script: String = block
        .replace("/tmp/csi/", &format!("{}/", scratch.display()))
        .lines()
        // The line that shows an error is expected to fail.
        .map(|l| {
            if l.contains("# error:") {
                format!("! {l}\n")
            } else {
                format!("{l}\n")
            }
        })
        .collect();
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_csi-driver"))
        .parent()
        .unwrap();
    let out = Command::new("bash")
        .args(["-euo", "pipefail", "-c", &script])
        .env(
            "PATH",
            format!(
                "{}:{}",
                bin_dir.display(),
                std::env::var("PATH").unwrap_or_default()
            ),
        )
        .env("CSI_ENDPOINT", format!("unix://{}", d.socket.display()))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the quick start failed:\n{script}\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(stdout.contains("ready: true"), "{stdout}");
    assert!(stderr.contains("InvalidArgument"), "{stderr}");
    assert!(ok(&d, &["list-volumes"]).contains("volumes: []"));
    assert!(ok(&d, &["list-snapshots"]).contains("snapshots: []"));
    assert!(mounts_below(&scratch).is_empty());
    assert!(loops_below(&pool.path).is_empty());
}
