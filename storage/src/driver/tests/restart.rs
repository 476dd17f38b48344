//! The records across a restart of the process.

use std::collections::BTreeMap;

use crate::testkit::*;
use crate::volumes::MIB;

#[test]
fn records_survive_a_reopen() {
    let mut w = World::new();
    let mut req = request("pvc-a", 64 * MIB as i64, 0, vec![ext4()]);
    req.mutable_parameters = params(&[("readAheadKiB", "512")]);
    let made = w.c().create_volume(req).unwrap().record;
    let id = made.id.to_string();
    w.stage(&id, &ext4()).unwrap();
    w.publish(&id, &w.target("t1"), &ext4(), false).unwrap();
    let snap = w
        .c()
        .create_snapshot("snap-1", &id, &BTreeMap::new())
        .unwrap();
    let node_before = w.node_record(&id).unwrap();

    w.reopen();
    assert_eq!(w.c().get_volume(&id).unwrap().record, made);
    assert_eq!(w.c().get_snapshot(&snap.id.to_string()).unwrap(), snap);
    assert_eq!(w.node_record(&id).unwrap(), node_before);
    // The reopened driver carries on where the first left off: nothing redone.
    let before = w.fake.counters();
    w.stage(&id, &ext4()).unwrap();
    w.publish(&id, &w.target("t1"), &ext4(), false).unwrap();
    let after = w.fake.counters();
    assert_eq!(
        (after.mount, after.bind, after.mkfs, after.attach),
        (before.mount, before.bind, before.mkfs, before.attach)
    );
    assert_eq!(w.pool_files("volumes"), vec![format!("{id}.img")]);
}

#[test]
fn an_unreadable_record_is_set_aside_and_its_data_kept() {
    let mut w = World::new();
    let id = w.create("pvc-a", ext4());
    let path = w
        .state_dir()
        .join("controller/volumes")
        .join(format!("{id}.json"));
    std::fs::write(&path, b"{ not json").unwrap();
    w.reopen();
    assert_eq!(w.pool_files("volumes"), vec![format!("{id}.img")]);
    assert!(path.with_extension("corrupt").exists());
    assert_eq!(kind(w.c().get_volume(&id)), Kind::NotFound);
}
