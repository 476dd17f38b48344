//! ListVolumes and DeleteVolume.

use crate::ids::VolumeId;
use crate::model::*;
use crate::testkit::*;

/// A page of ListVolumes, each volume answered by its id.
fn listed(w: &World, max: i32, token: &str) -> crate::Result<crate::volumes::VolumePage<String>> {
    w.c().list_volumes(max, token, |v| v.id.to_string())
}

#[test]
fn list_volumes_pages_with_tokens_and_refuses_foreign_ones() {
    let w = World::new();
    let mut made: Vec<String> = (0..5)
        .map(|i| w.create(&format!("pvc-{i}"), ext4()))
        .collect();
    made.sort();
    let mut seen = Vec::new();
    let mut token = String::new();
    let mut pages = 0;
    loop {
        let page = listed(&w, 2, &token).unwrap();
        assert!(page.volumes.len() <= 2);
        pages += 1;
        seen.extend(page.volumes);
        match page.next_token {
            Some(t) => token = t,
            None => break,
        }
    }
    assert_eq!(pages, 3);
    assert_eq!(seen, made, "every volume once, in id order");
    assert_eq!(listed(&w, 0, "").unwrap().volumes.len(), 5);

    assert_eq!(kind(listed(&w, 2, "not-a-token")), Kind::Aborted);
    assert_eq!(kind(listed(&w, 2, &made[0].to_uppercase())), Kind::Aborted);
    assert_eq!(kind(listed(&w, -1, "")), Kind::InvalidArgument);
    // A token of a volume deleted since is still a place in the order.
    w.c().delete_volume(&made[1]).unwrap();
    let page = listed(&w, 0, &made[1]).unwrap();
    assert_eq!(page.volumes, made[2..].to_vec());
}

#[test]
fn volumes_half_made_are_not_listed() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    let mut rec = w.c().volumes.get(VolumeId::parse(&id).unwrap()).unwrap();
    rec.state = RecordState::Creating;
    w.c().volumes.put(&rec).unwrap();
    assert!(listed(&w, 0, "").unwrap().volumes.is_empty());
    assert_eq!(kind(w.c().get_volume(&id)), Kind::NotFound);
}

#[test]
fn delete_of_an_id_that_is_no_uuid_succeeds_and_touches_nothing() {
    let w = World::new();
    let id = w.create("pvc-a", ext4());
    let before = w.pool_files("volumes");
    for bogus in ["not-a-uuid", "../volumes", "pvc-a", &id.to_uppercase()] {
        w.c().delete_volume(bogus).unwrap();
    }
    assert_eq!(w.pool_files("volumes"), before);
    assert_eq!(w.c().volume_count(), 1);
    assert_eq!(
        w.fake.counters(),
        Default::default(),
        "no system call at all"
    );
    assert_eq!(kind(w.c().delete_volume("")), Kind::InvalidArgument);
    // A well-formed id of nothing: success too.
    w.c()
        .delete_volume(&VolumeId::for_name("never").to_string())
        .unwrap();
}

#[test]
fn delete_of_a_staged_volume_is_refused_until_unstaged() {
    let w = World::new();
    let id = w.create_staged("pvc-a");
    assert_eq!(kind(w.c().delete_volume(&id)), Kind::FailedPrecondition);
    assert_eq!(w.pool_files("volumes").len(), 1);
    w.n()
        .node_unstage(&id, &w.staging().display().to_string())
        .unwrap();
    w.c().delete_volume(&id).unwrap();
    assert!(w.pool_files("volumes").is_empty());
    assert_eq!(w.c().volume_count(), 0);
}
