//! gRPC clients other than Go's, at their defaults, against the real driver on its
//! Unix socket: Python grpcio (grpc C-core, which names the socket's path as the
//! HTTP/2 `:authority`) and grpcurl without `-authority`.
//!
//! The tools come from scripts/install-deps.sh (a virtualenv with grpcio and
//! grpcio-tools, and grpcurl through `go install`). Like the other root tests, these
//! run only when asked for (`-- --include-ignored`); a test that cannot find its
//! tool then fails.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

/// Where scripts/install-deps.sh makes the Python environment with grpcio.
const GRPC_VENV_PYTHON: &str = "/opt/example-csi/grpc-venv/bin/python";

/// A tool is missing: the test cannot check what it is for.
fn missing(what: &str) -> ! {
    panic!("{what} is not installed; scripts/install-deps.sh installs it");
}

/// A Python that imports grpc and grpc_tools.
fn grpc_python() -> Option<PathBuf> {
    let candidates = std::env::var("EXAMPLE_CSI_GRPC_PYTHON")
        .ok()
        .into_iter()
        .chain([GRPC_VENV_PYTHON.to_string(), "python3".to_string()]);
    for c in candidates {
        let ok = Command::new(&c)
            .args(["-c", "import grpc, grpc_tools"])
            .output()
            .is_ok_and(|o| o.status.success());
        if ok {
            return Some(PathBuf::from(c));
        }
    }
    None
}

fn grpcurl() -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    if let Some(home) = std::env::var_os("HOME") {
        dirs.push(Path::new(&home).join("go/bin"));
    }
    dirs.push("/root/go/bin".into());
    if let Ok(o) = Command::new("go").args(["env", "GOPATH"]).output() {
        let gopath = String::from_utf8_lossy(&o.stdout).trim().to_string();
        if !gopath.is_empty() {
            dirs.push(Path::new(&gopath).join("bin"));
        }
    }
    dirs.into_iter()
        .map(|d| d.join("grpcurl"))
        .find(|p| p.is_file())
}

fn proto_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("proto")
}

/// The calls, made the way a Python user would: `unix:PATH` and no channel options.
const PYTHON_CLIENT: &str = r#"
import json, sys
import grpc
import csi_pb2, csi_pb2_grpc

sock = sys.argv[1]
with grpc.insecure_channel("unix:" + sock) as channel:
    identity = csi_pb2_grpc.IdentityStub(channel)
    node = csi_pb2_grpc.NodeStub(channel)
    info = identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest(), timeout=30)
    probe = identity.Probe(csi_pb2.ProbeRequest(), timeout=30)
    node_info = node.NodeGetInfo(csi_pb2.NodeGetInfoRequest(), timeout=30)
    # A second round on the same channel: HPACK's dynamic table is in use now.
    again = identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest(), timeout=30)
    try:
        node.NodeUnstageVolume(csi_pb2.NodeUnstageVolumeRequest(), timeout=30)
        unstage = "OK"
    except grpc.RpcError as e:
        unstage = e.code().name
print(json.dumps({
    "name": info.name,
    "again": again.name,
    "ready": probe.ready.value,
    "node_id": node_info.node_id,
    "unstage": unstage,
}))
"#;

#[tokio::test]
#[ignore = "needs root (loop devices and mounts) and the tools of scripts/install-deps.sh"]
async fn root_python_grpcio_at_its_defaults_is_served() {
    require_root();
    let Some(python) = grpc_python() else {
        missing("Python with grpcio and grpcio-tools");
    };
    let pool = Pool::new("xfs");
    let driver = Driver::start(&pool, &[]);
    let stubs = tempfile::tempdir().unwrap();
    let include = Command::new(&python)
        .args([
            "-c",
            "import grpc_tools, os; print(os.path.join(os.path.dirname(grpc_tools.__file__), '_proto'))",
        ])
        .output()
        .unwrap();
    let include = String::from_utf8_lossy(&include.stdout).trim().to_string();
    let gen = Command::new(&python)
        .args(["-m", "grpc_tools.protoc"])
        .arg(format!("-I{}", proto_dir().display()))
        .arg(format!("-I{include}"))
        .arg(format!("--python_out={}", stubs.path().display()))
        .arg(format!("--grpc_python_out={}", stubs.path().display()))
        .arg("csi.proto")
        .output()
        .unwrap();
    assert!(
        gen.status.success(),
        "protoc: {}",
        String::from_utf8_lossy(&gen.stderr)
    );
    let script = stubs.path().join("client.py");
    std::fs::write(&script, PYTHON_CLIENT).unwrap();
    let out = Command::new(&python)
        .arg(&script)
        .arg(&driver.socket)
        .current_dir(stubs.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the Python client failed: {}\ndriver log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        driver.log_text()
    );
    let answer: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("the client prints JSON");
    assert_eq!(answer["name"], "example.csi.k8s.io");
    assert_eq!(answer["again"], "example.csi.k8s.io");
    assert_eq!(answer["ready"], true);
    assert_eq!(answer["node_id"], "test-node");
    // An invalid request still gets the CSI code, not a transport error.
    assert_eq!(answer["unstage"], "INVALID_ARGUMENT");
    // The client did send a malformed :authority, so the fix was what made it work.
    assert!(
        driver
            .log_text()
            .contains("a client named the socket path as :authority"),
        "grpcio sent a valid :authority: this test no longer shows the fix"
    );
}

#[tokio::test]
#[ignore = "needs root (loop devices and mounts) and the tools of scripts/install-deps.sh"]
async fn root_grpcurl_without_authority_is_served() {
    require_root();
    let Some(grpcurl) = grpcurl() else {
        missing("grpcurl");
    };
    let pool = Pool::new("xfs");
    let driver = Driver::start(&pool, &[]);
    let call = |method: &str| -> serde_json::Value {
        let out = Command::new(&grpcurl)
            .args(["-plaintext", "-unix", "-max-time", "30", "-import-path"])
            .arg(proto_dir())
            .args(["-proto", "csi.proto", "-d", "{}"])
            .arg(&driver.socket)
            .arg(method)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "grpcurl {method}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("grpcurl prints JSON")
    };
    assert_eq!(
        call("csi.v1.Identity/GetPluginInfo")["name"],
        "example.csi.k8s.io"
    );
    assert_eq!(call("csi.v1.Identity/Probe")["ready"], true);
    assert_eq!(call("csi.v1.Node/NodeGetInfo")["nodeId"], "test-node");
}
