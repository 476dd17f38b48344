//! NodeExpandVolume: grows what is smaller, and nothing else.

use crate::model::*;
use crate::testkit::*;
use crate::volumes::MIB;
use crate::Result;

fn node_expand(w: &World, id: &str, required: u64) -> Result<u64> {
    w.n().node_expand(
        id,
        &w.staging().display().to_string(),
        CapacityRange {
            required: required as i64,
            limit: 0,
        },
        None,
    )
}

#[test]
fn node_expand_to_the_size_a_volume_has_grows_nothing() {
    let w = World::new();
    for (fs, size) in [("ext4", 64 * MIB), ("xfs", 300 * MIB), ("btrfs", 128 * MIB)] {
        let cap = mount_cap(fs, AccessMode::SingleNodeWriter);
        let id = w
            .c()
            .create_volume(request(
                &format!("pvc-{fs}"),
                size as i64,
                0,
                vec![cap.clone()],
            ))
            .unwrap()
            .id
            .to_string();
        w.stage(&id, &cap).unwrap();
        let grown = w.fake.counters().grow;
        assert_eq!(node_expand(&w, &id, size).unwrap(), size, "{fs}: same size");
        assert_eq!(
            node_expand(&w, &id, size / 2).unwrap(),
            size,
            "{fs}: smaller"
        );
        assert_eq!(node_expand(&w, &id, 0).unwrap(), size, "{fs}: no size");
        assert_eq!(w.fake.counters().grow, grown, "{fs}: no grow was tried");
        w.n()
            .node_unstage(&id, &w.staging().display().to_string())
            .unwrap();
    }
}

#[test]
fn node_expand_grows_what_is_smaller_and_refuses_a_btrfs_below_256_mib() {
    let w = World::new();
    let id = w.create_staged("pvc-a");
    assert_eq!(node_expand(&w, &id, 96 * MIB).unwrap(), 96 * MIB);
    assert_eq!(w.fake.counters().grow, 1);
    assert_eq!(node_expand(&w, &id, 96 * MIB).unwrap(), 96 * MIB);
    assert_eq!(w.fake.counters().grow, 1, "the retry grows nothing");
    w.n()
        .node_unstage(&id, &w.staging().display().to_string())
        .unwrap();

    // The kernel resizes no btrfs to less than 256 MiB: said, not tried.
    let cap = mount_cap("btrfs", AccessMode::SingleNodeWriter);
    let id = w
        .c()
        .create_volume(request("pvc-b", 128 * MIB as i64, 0, vec![cap.clone()]))
        .unwrap()
        .id
        .to_string();
    w.stage(&id, &cap).unwrap();
    let err = node_expand(&w, &id, 200 * MIB).unwrap_err();
    assert_eq!(err.kind(), Kind::OutOfRange, "{err}");
    assert!(err.to_string().contains("256 MiB"), "{err}");
    assert_eq!(w.fake.counters().grow, 1);
    // Staged again at that size, it is mounted as it is.
    w.n()
        .node_unstage(&id, &w.staging().display().to_string())
        .unwrap();
    w.stage(&id, &cap).unwrap();
    assert_eq!(w.fake.counters().grow, 1);
    assert_eq!(node_expand(&w, &id, 256 * MIB).unwrap(), 256 * MIB);
    assert_eq!(w.fake.counters().grow, 2);
}
