//! Mutable attributes on live loop devices: a change applies to the devices
//! serving a staged image at once, or to nothing when it cannot.

use csi_sys::fake::FakeOp;
use std::path::Path;

use csi_sys::SysError;

use crate::testkit::*;
use crate::volumes::MIB;

fn attr(path: &Path, key: &str) -> Option<String> {
    csi_sys::xattr::get(path, &format!("example-csi.{key}"))
        .unwrap()
        .map(|v| String::from_utf8(v).unwrap())
}

#[test]
fn modify_volume_that_cannot_be_applied_changes_nothing() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    let image = w.image(&id);
    w.stage(&id, &ext4()).unwrap();
    let dev = w.fake.loops()[0].device.clone();
    let read_ahead = || w.sys.loops.read_ahead_kib(&dev).unwrap();
    let asked = params(&[("directIO", "true"), ("readAheadKiB", "1024")]);
    let unchanged = |what: &str| {
        assert!(!w.fake.loops()[0].direct_io, "{what}: direct I/O put back");
        assert_eq!(
            read_ahead(),
            csi_sys::fake::DEFAULT_READ_AHEAD_KIB,
            "{what}"
        );
        assert_eq!(attr(&image, "directIO"), None, "{what}: attribute put back");
        assert_eq!(attr(&image, "readAheadKiB"), None, "{what}");
        let rec = w.c().get_volume(&id).unwrap();
        assert!(rec.mutable_parameters.is_empty(), "{what}: {rec:?}");
    };

    // The kernel refuses direct I/O for good (EINVAL): the parameter cannot be had.
    w.fake.fail_next(FakeOp::SetDirectIo, || {
        SysError::syscall("turn direct I/O on".into(), "/dev/loop0", libc::EINVAL)
    });
    assert_eq!(
        kind(w.c().modify_volume(&id, &asked)),
        Kind::InvalidArgument
    );
    unchanged("direct I/O refused");

    // Direct I/O is set, then the read-ahead fails: the direct I/O is undone.
    w.fake
        .fail_next(FakeOp::SetReadAheadKib, eio("write read_ahead_kb"));
    assert_eq!(kind(w.c().modify_volume(&id, &asked)), Kind::System);
    unchanged("read-ahead failed");

    // The settings of the device cannot even be read: nothing is tried.
    w.fake
        .fail_next(FakeOp::ReadAheadKib, eio("read read_ahead_kb"));
    assert_eq!(kind(w.c().modify_volume(&id, &asked)), Kind::System);
    unchanged("settings unreadable");

    // The retry applies everything.
    w.c().modify_volume(&id, &asked).unwrap();
    assert!(w.fake.loops()[0].direct_io);
    assert_eq!(read_ahead(), 1024);
    assert_eq!(attr(&image, "directIO").as_deref(), Some("true"));
    assert_eq!(w.c().get_volume(&id).unwrap().mutable_parameters, asked);

    // A change that fails on a volume with values already set puts those back.
    w.fake
        .fail_next(FakeOp::SetReadAheadKib, eio("write read_ahead_kb"));
    let r = w.c().modify_volume(
        &id,
        &params(&[("directIO", "false"), ("readAheadKiB", "64")]),
    );
    assert_eq!(kind(r), Kind::System);
    assert!(w.fake.loops()[0].direct_io);
    assert_eq!(read_ahead(), 1024);
    assert_eq!(attr(&image, "readAheadKiB").as_deref(), Some("1024"));
    assert_eq!(w.c().get_volume(&id).unwrap().mutable_parameters, asked);
}

#[test]
fn modify_volume_not_staged_here_is_recorded_for_the_next_stage() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    let asked = params(&[("directIO", "true"), ("readAheadKiB", "512")]);
    w.c().modify_volume(&id, &asked).unwrap();
    assert_eq!(w.fake.counters().set_direct_io, 0, "no device to change");
    w.stage(&id, &ext4()).unwrap();
    let dev = &w.fake.loops()[0];
    assert!(dev.direct_io);
    assert_eq!(w.sys.loops.read_ahead_kib(&dev.device).unwrap(), 512);
}

#[test]
fn stage_that_cannot_apply_the_recorded_settings_fails_and_leaves_nothing() {
    let w = World::new();
    let mut req = request("pvc-a", 64 * MIB as i64, 0, vec![ext4()]);
    req.mutable_parameters = params(&[("readAheadKiB", "1024")]);
    let id = w.c().create_volume(req).unwrap().id.to_string();
    let nothing_left = |what: &str| {
        assert!(w.fake.loops().is_empty(), "{what}: loop device detached");
        assert!(w.fake.mounts().is_empty(), "{what}: nothing mounted");
        assert!(w.node_record(&id).is_none(), "{what}: no node record");
    };

    w.fake
        .fail_next(FakeOp::SetReadAheadKib, eio("write read_ahead_kb"));
    assert_eq!(kind(w.stage(&id, &ext4())), Kind::System);
    nothing_left("read-ahead failed");

    // An attribute that cannot be understood is an error, not "not set".
    let image = w.image(&id);
    csi_sys::xattr::set(&image, "example-csi.readAheadKiB", b"lots").unwrap();
    let err = w.stage(&id, &ext4()).unwrap_err();
    assert_eq!(err.kind(), Kind::Internal);
    assert!(err.to_string().contains("readAheadKiB"), "{err}");
    nothing_left("damaged attribute");

    csi_sys::xattr::set(&image, "example-csi.readAheadKiB", b"1024").unwrap();
    w.stage(&id, &ext4()).unwrap();
    let dev = &w.fake.loops()[0];
    assert_eq!(w.sys.loops.read_ahead_kib(&dev.device).unwrap(), 1024);
}
