//! CreateVolume: idempotent by name, sizes rounded and bounded, bad requests
//! refused before anything is made.

use std::collections::BTreeMap;

use crate::ids::SnapshotId;
use crate::model::*;
use crate::testkit::*;
use crate::volumes::{Capacity, CreateVolume, MIB};

#[test]
fn create_volume_is_idempotent_and_conflicts_are_already_exists() {
    let w = World::new();
    let req = request("pvc-a", 64 * MIB as i64, 0, vec![ext4()]);
    let first = w.c().create_volume(req.clone()).unwrap();
    let again = w.c().create_volume(req.clone()).unwrap();
    assert_eq!(first, again);
    assert_eq!(w.pool_files("volumes").len(), 1);

    // A range the existing size satisfies is the same volume.
    let within = request("pvc-a", 32 * MIB as i64, 128 * MIB as i64, vec![ext4()]);
    assert_eq!(w.c().create_volume(within).unwrap().id, first.id);

    let bigger = request("pvc-a", 128 * MIB as i64, 0, vec![ext4()]);
    assert_eq!(kind(w.c().create_volume(bigger)), Kind::AlreadyExists);
    let other_fs = request(
        "pvc-a",
        64 * MIB as i64,
        0,
        vec![mount_cap("xfs", AccessMode::SingleNodeWriter)],
    );
    assert_eq!(kind(w.c().create_volume(other_fs)), Kind::AlreadyExists);
    let as_block = request("pvc-a", 64 * MIB as i64, 0, vec![block()]);
    assert_eq!(kind(w.c().create_volume(as_block)), Kind::AlreadyExists);
    let mut as_dir = req.clone();
    as_dir.parameters = params(&[("kind", "dir")]);
    assert_eq!(kind(w.c().create_volume(as_dir)), Kind::AlreadyExists);
    let mut from_snapshot = req.clone();
    from_snapshot.source = Some(ContentSource::Snapshot(SnapshotId::for_name("s")));
    assert_eq!(
        kind(w.c().create_volume(from_snapshot)),
        Kind::AlreadyExists
    );

    // None of the conflicts changed the volume.
    assert_eq!(w.c().volume_count(), 1);
    let len = std::fs::metadata(w.image(&first.id.to_string()))
        .unwrap()
        .len();
    assert_eq!(len, 64 * MIB);
}

#[test]
fn a_create_left_half_done_is_started_over() {
    let w = World::new();
    let req = request("pvc-a", 64 * MIB as i64, 0, vec![ext4()]);
    let info = w.c().create_volume(req.clone()).unwrap();
    let mut rec = info.clone();
    rec.state = RecordState::Creating;
    rec.size = 8 * MIB; // what the crashed attempt was making
    w.c().volumes.put(&rec).unwrap();
    let again = w.c().create_volume(req).unwrap();
    assert_eq!(again.state, RecordState::Ready);
    assert_eq!(again.size, 64 * MIB);
}

#[test]
fn sizes_are_rounded_to_the_filesystem_minimum_and_whole_mebibytes() {
    let w = World::new();
    let xfs = mount_cap("xfs", AccessMode::SingleNodeWriter);
    let btrfs = mount_cap("btrfs", AccessMode::SingleNodeWriter);
    let cases: Vec<(&str, i64, i64, Vec<Capability>, u64)> = vec![
        ("ext4-one-byte", 1, 0, vec![ext4()], 8 * MIB),
        ("xfs-one-byte", 1, 0, vec![xfs.clone()], 300 * MIB),
        ("btrfs-one-byte", 1, 0, vec![btrfs], 128 * MIB),
        ("block-one-byte", 1, 0, vec![block()], MIB),
        ("odd", 10 * MIB as i64 + 1, 0, vec![ext4()], 11 * MIB),
        // No required size: the default (1 GiB), or the limit if that is less.
        ("default", 0, 0, vec![ext4()], 1024 * MIB),
        ("limit-only", 0, 20 * MIB as i64, vec![ext4()], 20 * MIB),
        // Rounding up to a MiB would pass the limit: 4 KiB rounding instead.
        (
            "tight-limit",
            8 * MIB as i64 + 1,
            8 * MIB as i64 + 4096,
            vec![ext4()],
            8 * MIB + 4096,
        ),
    ];
    for (name, required, limit, caps, want) in cases {
        let info = w
            .c()
            .create_volume(request(name, required, limit, caps))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(info.size, want, "{name}");
        let len = std::fs::metadata(w.image(&info.id.to_string()))
            .unwrap()
            .len();
        assert_eq!(len, want, "{name}: the image is as large as recorded");
    }
}

#[test]
fn sizes_beyond_the_limit_or_the_pool_are_out_of_range() {
    let w = World::new();
    let xfs = mount_cap("xfs", AccessMode::SingleNodeWriter);
    // The filesystem's minimum does not fit under the limit.
    let small = request("xfs-small", 0, 100 * MIB as i64, vec![xfs]);
    assert_eq!(kind(w.c().create_volume(small)), Kind::OutOfRange);
    let small = request("ext4-small", 1, 4 * MIB as i64, vec![ext4()]);
    assert_eq!(kind(w.c().create_volume(small)), Kind::OutOfRange);
    // Larger than the pool's filesystem.
    let huge = request("huge", 1 << 60, 0, vec![ext4()]);
    assert_eq!(kind(w.c().create_volume(huge)), Kind::OutOfRange);
    // required above limit is a malformed range.
    let bad = request("bad", 20 * MIB as i64, 10 * MIB as i64, vec![ext4()]);
    assert_eq!(kind(w.c().create_volume(bad)), Kind::InvalidArgument);
    let negative = request("negative", -1, 0, vec![ext4()]);
    assert_eq!(kind(w.c().create_volume(negative)), Kind::InvalidArgument);
    assert_eq!(w.c().volume_count(), 0);
    assert!(w.pool_files("volumes").is_empty());
}

#[test]
fn bad_parameters_are_invalid_argument_and_make_nothing() {
    let w = World::new();
    let ok = || request("pvc-a", 64 * MIB as i64, 0, vec![ext4()]);
    let with_params = |kv: &[(&str, &str)]| {
        let mut r = ok();
        r.parameters = params(kv);
        r
    };
    let with_caps = |caps: Vec<Capability>| {
        let mut r = ok();
        r.capabilities = caps;
        r
    };
    let mut flags = ext4();
    if let Access::Mount { mount_flags, .. } = &mut flags.access {
        mount_flags.push("suid".into());
    }
    let mut nameless = ok();
    nameless.name = String::new();
    let mut long_name = ok();
    long_name.name = "n".repeat(129);
    let mut elsewhere = ok();
    elsewhere.requisite = vec![params(&[(TOPOLOGY_KEY, "node-2")])];
    let cases: Vec<(&str, CreateVolume, Kind)> = vec![
        (
            "unknown key",
            with_params(&[("color", "red")]),
            Kind::InvalidArgument,
        ),
        (
            "unknown kind",
            with_params(&[("kind", "lvm")]),
            Kind::InvalidArgument,
        ),
        (
            "unknown pool",
            with_params(&[("type", "fast")]),
            Kind::InvalidArgument,
        ),
        (
            "bandwidth without a number",
            with_params(&[("transferBandwidth", "fast")]),
            Kind::InvalidArgument,
        ),
        (
            "negative bandwidth",
            with_params(&[("transferBandwidth", "-1Mi")]),
            Kind::InvalidArgument,
        ),
        (
            "block on dir",
            {
                let mut r = with_params(&[("kind", "dir")]);
                r.capabilities = vec![block()];
                r
            },
            Kind::InvalidArgument,
        ),
        ("no capabilities", with_caps(vec![]), Kind::InvalidArgument),
        (
            "multi-node",
            with_caps(vec![mount_cap("ext4", AccessMode::MultiNodeMultiWriter)]),
            Kind::InvalidArgument,
        ),
        (
            "unknown mode",
            with_caps(vec![mount_cap("ext4", AccessMode::Unknown)]),
            Kind::InvalidArgument,
        ),
        (
            "unknown fs",
            with_caps(vec![mount_cap("ntfs", AccessMode::SingleNodeWriter)]),
            Kind::InvalidArgument,
        ),
        (
            "two filesystems",
            with_caps(vec![ext4(), mount_cap("xfs", AccessMode::SingleNodeWriter)]),
            Kind::InvalidArgument,
        ),
        (
            "unsafe mount flag",
            with_caps(vec![flags]),
            Kind::InvalidArgument,
        ),
        ("no name", nameless, Kind::InvalidArgument),
        ("long name", long_name, Kind::InvalidArgument),
        ("another node", elsewhere, Kind::ResourceExhausted),
    ];
    for (what, req, want) in cases {
        assert_eq!(kind(w.c().create_volume(req)), want, "{what}");
    }
    assert_eq!(w.c().volume_count(), 0);
    assert!(w.pool_files("volumes").is_empty());
    // The k8s-prefixed keys and this node's own topology are accepted.
    let mut fine = with_params(&[("csi.storage.k8s.io/pvc/name", "x"), ("kind", "image")]);
    fine.requisite = vec![params(&[(TOPOLOGY_KEY, "node-1")])];
    w.c().create_volume(fine).unwrap();
}

#[test]
fn a_transfer_bandwidth_is_a_quantity_kept_with_the_volume() {
    let w = World::new();
    let mut r = request("pvc-a", 64 * MIB as i64, 0, vec![ext4()]);
    r.parameters = params(&[("transferBandwidth", "64Mi")]);
    let v = w.c().create_volume(r.clone()).unwrap();
    assert_eq!(v.parameters.get("transferBandwidth").unwrap(), "64Mi");
    let parsed = crate::volumes::parse_parameters(&v.parameters).unwrap();
    assert_eq!(parsed.transfer_bandwidth, 64 * MIB);
    // The same request again is the same volume; another bandwidth is not.
    assert_eq!(w.c().create_volume(r.clone()).unwrap().id, v.id);
    r.parameters = params(&[("transferBandwidth", "1Gi")]);
    assert_eq!(kind(w.c().create_volume(r)), Kind::AlreadyExists);
}

#[test]
fn a_mutable_transfer_bandwidth_is_kept_in_the_record_alone_and_takes_the_class_place() {
    let w = World::new();
    let bw = |rec: &crate::model::VolumeRecord| crate::volumes::transfer_cap(rec);
    let mut r = request("pvc-a", 64 * MIB as i64, 0, vec![ext4()]);
    r.parameters = params(&[("transferBandwidth", "64Mi")]);
    r.mutable_parameters = params(&[("transferBandwidth", "8Mi"), ("readAheadKiB", "512")]);
    let id = w.c().create_volume(r).unwrap().id.to_string();
    let rec = w.c().get_volume(&id).unwrap();
    assert_eq!(bw(&rec), 8 * MIB);
    // The image carries the loop device's attribute, not the bandwidth.
    let image = w.image(&id);
    let attr = |k: &str| csi_sys::xattr::get(&image, &format!("example-csi.{k}")).unwrap();
    assert_eq!(attr("readAheadKiB").as_deref(), Some(&b"512"[..]));
    assert_eq!(attr("transferBandwidth"), None);

    // Changed alone, on an image staged here: the loop device is not asked.
    w.stage(&id, &ext4()).unwrap();
    let before = w.fake.read_ahead_kib(&w.fake.loops()[0].device);
    w.c()
        .modify_volume(&id, &params(&[("transferBandwidth", "0")]))
        .unwrap();
    let rec = w.c().get_volume(&id).unwrap();
    assert_eq!(bw(&rec), 0, "0 lifts the class's cap too");
    assert_eq!(w.fake.read_ahead_kib(&w.fake.loops()[0].device), before);
    assert_eq!(attr("transferBandwidth"), None);
    // What is no quantity is refused, and changes nothing.
    for bad in ["fast", "-1Mi", "1.5Mi"] {
        let m = params(&[("transferBandwidth", bad), ("readAheadKiB", "64")]);
        assert_eq!(
            kind(w.c().modify_volume(&id, &m)),
            Kind::InvalidArgument,
            "{bad}"
        );
    }
    let rec = w.c().get_volume(&id).unwrap();
    assert_eq!(
        rec.mutable_parameters,
        params(&[("transferBandwidth", "0"), ("readAheadKiB", "512")])
    );

    // A directory volume takes it too (its data may come from another node).
    let mut dir = request("pvc-dir", 64 * MIB as i64, 0, vec![ext4()]);
    dir.parameters = params(&[("kind", "dir")]);
    dir.mutable_parameters = params(&[("transferBandwidth", "1Mi")]);
    let dir_id = w.c().create_volume(dir).unwrap().id.to_string();
    assert_eq!(bw(&w.c().get_volume(&dir_id).unwrap()), MIB);
    // Without attributes, the class's parameter caps it.
    let mut plain = request("pvc-plain", 64 * MIB as i64, 0, vec![ext4()]);
    plain.parameters = params(&[("transferBandwidth", "3Mi")]);
    let plain_id = w.c().create_volume(plain).unwrap().id.to_string();
    assert_eq!(bw(&w.c().get_volume(&plain_id).unwrap()), 3 * MIB);
}

#[test]
fn mutable_parameters_must_apply_to_the_kind_of_volume() {
    let w = World::new();
    // directIO on an image: kept as an attribute, applied at attach.
    let mut image = request("pvc-img", 64 * MIB as i64, 0, vec![ext4()]);
    image.mutable_parameters = params(&[("directIO", "true"), ("readAheadKiB", "1024")]);
    let info = w.c().create_volume(image).unwrap();
    let id = info.id.to_string();
    let path = w.image(&id);
    let attr = csi_sys::xattr::get(&path, "example-csi.directIO").unwrap();
    assert_eq!(attr.as_deref(), Some(&b"true"[..]));
    w.stage(&id, &ext4()).unwrap();
    let dev = &w.fake.loops()[0];
    assert!(
        dev.direct_io,
        "the loop device was attached with direct I/O"
    );
    assert_eq!(w.fake.read_ahead_kib(&dev.device), Some(1024));
    // Modified while staged: applied to the live device at once.
    w.c()
        .modify_volume(&id, &params(&[("directIO", "false")]))
        .unwrap();
    assert!(!w.fake.loops()[0].direct_io);

    // compression means something only on a btrfs subvolume; this pool is not btrfs.
    let mut dir = request("pvc-dir", 64 * MIB as i64, 0, vec![ext4()]);
    dir.parameters = params(&[("kind", "dir")]);
    dir.mutable_parameters = params(&[("compression", "zstd")]);
    assert_eq!(
        kind(w.c().create_volume(dir.clone())),
        Kind::InvalidArgument
    );
    dir.mutable_parameters = params(&[("directIO", "true")]);
    assert_eq!(
        kind(w.c().create_volume(dir.clone())),
        Kind::InvalidArgument
    );
    let mut image = request("pvc-img2", 64 * MIB as i64, 0, vec![ext4()]);
    image.mutable_parameters = params(&[("compression", "zstd")]);
    assert_eq!(
        kind(w.c().create_volume(image.clone())),
        Kind::InvalidArgument
    );
    // Values and names are checked too.
    image.mutable_parameters = params(&[("directIO", "maybe")]);
    assert_eq!(
        kind(w.c().create_volume(image.clone())),
        Kind::InvalidArgument
    );
    image.mutable_parameters = params(&[("readAheadKiB", "65537")]);
    assert_eq!(
        kind(w.c().create_volume(image.clone())),
        Kind::InvalidArgument
    );
    image.mutable_parameters = params(&[("iops", "100")]);
    assert_eq!(kind(w.c().create_volume(image)), Kind::InvalidArgument);
    assert_eq!(w.c().volume_count(), 1);

    // ModifyVolume applies the same rules, and changes nothing when it refuses.
    dir.mutable_parameters = BTreeMap::new();
    let dir_id = w.c().create_volume(dir).unwrap().id.to_string();
    assert_eq!(
        kind(
            w.c()
                .modify_volume(&dir_id, &params(&[("compression", "lzo")]))
        ),
        Kind::InvalidArgument
    );
    assert_eq!(
        kind(w.c().modify_volume(
            &id,
            &params(&[("readAheadKiB", "64"), ("compression", "lzo")])
        )),
        Kind::InvalidArgument
    );
    let rec = w.c().get_volume(&id).unwrap();
    assert_eq!(
        rec.mutable_parameters,
        params(&[("directIO", "false"), ("readAheadKiB", "1024")])
    );
}

#[test]
fn a_driver_configured_without_a_mutable_parameter_refuses_it() {
    let w = World::with(|c| c.mutable_parameters = vec!["readAheadKiB".into()]);
    let mut image = request("pvc-img", 64 * MIB as i64, 0, vec![ext4()]);
    image.mutable_parameters = params(&[("directIO", "true")]);
    assert_eq!(kind(w.c().create_volume(image)), Kind::InvalidArgument);
}

#[test]
fn a_volume_made_larger_than_asked_lets_its_snapshots_restore_at_the_asked_size() {
    let w = World::new();
    // 1 MiB of ext4 is made as the filesystem's 8 MiB minimum.
    let small = w
        .c()
        .create_volume(request("pvc-small", MIB as i64, 0, vec![ext4()]))
        .unwrap();
    assert_eq!(small.size, 8 * MIB);
    assert_eq!(small.requested, Some(MIB));
    let id = small.id.to_string();
    let snap = w
        .c()
        .create_snapshot("snap-small", &id, &BTreeMap::new())
        .unwrap();
    assert_eq!(snap.size, 8 * MIB, "the data is the whole image");
    assert_eq!(snap.restore_size(), MIB, "a restore needs what was asked");

    // A restore asking for the source's asked size is made as large as the data.
    let mut restore = request("pvc-restore", MIB as i64, 0, vec![ext4()]);
    restore.source = Some(ContentSource::Snapshot(snap.id));
    let restored = w.c().create_volume(restore).unwrap();
    assert_eq!(restored.size, 8 * MIB);
    assert_eq!(restored.requested, Some(MIB));
    // ... but not squeezed below it.
    let mut capped = request("pvc-capped", MIB as i64, MIB as i64, vec![ext4()]);
    capped.source = Some(ContentSource::Snapshot(snap.id));
    assert_eq!(kind(w.c().create_volume(capped)), Kind::OutOfRange);

    // Grown to a size of its own, the volume promises that size.
    w.c()
        .expand_volume(
            &id,
            CapacityRange {
                required: 16 * MIB as i64,
                limit: 0,
            },
            None,
        )
        .unwrap();
    let grown = w
        .c()
        .create_snapshot("snap-grown", &id, &BTreeMap::new())
        .unwrap();
    assert_eq!((grown.size, grown.restore_size()), (16 * MIB, 16 * MIB));

    // Asked for exactly what is made: no separate size is kept.
    let exact = w
        .c()
        .create_volume(request("pvc-exact", 64 * MIB as i64, 0, vec![ext4()]))
        .unwrap();
    assert_eq!(exact.requested, None);
}

#[test]
fn capacity_lets_a_class_create_volume_refuses_through_to_its_refusal() {
    let w = World::new();
    let here = w.c().topology();
    let other = BTreeMap::from([(TOPOLOGY_KEY.to_string(), "node-2".to_string())]);
    let good = w.c().get_capacity(&params(&[]), &[], Some(&here)).unwrap();
    assert!(good.available > 0 && good.available < Capacity::UNLIMITED.available);
    // Each with what the refusal must name.
    for (bad, named) in [
        (("type", "nvme-does-not-exist"), "nvme-does-not-exist"),
        (("kind", "lvm"), "lvm"),
        (("color", "red"), "color"),
    ] {
        let p = params(&[bad]);
        // No figure that would keep the scheduler away from this node...
        for topology in [Some(&here), None] {
            assert_eq!(
                w.c().get_capacity(&p, &[ext4()], topology).unwrap(),
                Capacity::UNLIMITED,
                "{bad:?}"
            );
        }
        // ...where the class could not be served anyway, another node's.
        assert_eq!(
            w.c().get_capacity(&p, &[], Some(&other)).unwrap(),
            Capacity::NONE
        );
        // CreateVolume then says why, and makes nothing.
        let mut req = request("pvc-bad", 64 * MIB as i64, 0, vec![ext4()]);
        req.parameters = p;
        let e = w.c().create_volume(req).unwrap_err();
        assert_eq!(e.kind(), Kind::InvalidArgument, "{bad:?}: {e}");
        assert!(e.to_string().contains(named), "{bad:?}: {e}");
    }
    let mut req = request("pvc-bad", 64 * MIB as i64, 0, vec![ext4()]);
    req.parameters = params(&[("type", "nvme-does-not-exist")]);
    let why = w.c().create_volume(req).unwrap_err().to_string();
    assert!(
        why.contains("StorageClass parameter type") && why.contains("has the pools default"),
        "{why}"
    );
    assert_eq!(w.c().volume_count(), 0);
    assert!(w.pool_files("volumes").is_empty());
}
