//! Identifiers. Volume, snapshot and group snapshot ids are UUIDv5s of the request
//! name in namespaces of this driver, so a retry after a crash finds what the first
//! attempt left behind. Because an id is always a canonical UUID, it is safe to use
//! as a path component; anything else is rejected before it reaches a path.

use std::fmt;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::error::{Error, Result};

/// Longest name accepted for a volume, snapshot or group snapshot (the CSI spec's
/// recommended limit for string fields).
pub const MAX_NAME_BYTES: usize = 128;

const VOLUME_NS: Uuid = Uuid::from_u128(0x6f1c_8a4e_2b7d_4c59_9e10_3d5a_7b42_c001);
const SNAPSHOT_NS: Uuid = Uuid::from_u128(0x6f1c_8a4e_2b7d_4c59_9e10_3d5a_7b42_c002);
const GROUP_NS: Uuid = Uuid::from_u128(0x6f1c_8a4e_2b7d_4c59_9e10_3d5a_7b42_c003);
const EPHEMERAL_NS: Uuid = Uuid::from_u128(0x6f1c_8a4e_2b7d_4c59_9e10_3d5a_7b42_c004);

/// Checks a request name: required, at most [`MAX_NAME_BYTES`], no control characters.
pub fn validate_name(what: &str, name: &str) -> Result<()> {
    if name.is_empty() {
        return Err(Error::invalid(format!("{what} name is required")));
    }
    if name.len() > MAX_NAME_BYTES {
        return Err(Error::invalid(format!(
            "{what} name is {} bytes long; at most {MAX_NAME_BYTES} are accepted",
            name.len()
        )));
    }
    if name.chars().any(char::is_control) {
        return Err(Error::invalid(format!(
            "{what} name contains a control character"
        )));
    }
    Ok(())
}

macro_rules! uuid_id {
    ($name:ident, $ns:expr, $what:literal) => {
        #[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(Uuid);

        impl $name {
            /// The id that a request with this name always gets.
            pub fn for_name(name: &str) -> Self {
                $name(Uuid::new_v5(&$ns, name.as_bytes()))
            }

            /// Parses an id given by a caller. Only the canonical hyphenated lowercase
            /// form is accepted, so one object has exactly one spelling.
            pub fn parse(s: &str) -> Option<Self> {
                let u = Uuid::try_parse(s).ok()?;
                (u.hyphenated().to_string() == s).then_some($name(u))
            }

            /// Like [`parse`](Self::parse), but a malformed id is NOT_FOUND: it names
            /// nothing that exists.
            pub fn parse_existing(s: &str) -> Result<Self> {
                if s.is_empty() {
                    return Err(Error::invalid(concat!($what, " id is required")));
                }
                Self::parse(s).ok_or_else(|| {
                    Error::not_found(format!(concat!($what, " {:?} does not exist"), s))
                })
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0.hyphenated(), f)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(self, f)
            }
        }
    };
}

uuid_id!(VolumeId, VOLUME_NS, "volume");
uuid_id!(SnapshotId, SNAPSHOT_NS, "snapshot");
uuid_id!(GroupSnapshotId, GROUP_NS, "group snapshot");

impl VolumeId {
    /// The id of the volume backing an ephemeral inline volume, derived from the id
    /// kubelet gives it so that a retried publish finds it again.
    pub fn for_ephemeral(kubelet_volume_id: &str) -> Self {
        VolumeId(Uuid::new_v5(&EPHEMERAL_NS, kubelet_volume_id.as_bytes()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_derive_from_names_and_differ_by_kind() {
        let v = VolumeId::for_name("pvc-1");
        assert_eq!(v, VolumeId::for_name("pvc-1"));
        assert_ne!(v, VolumeId::for_name("pvc-2"));
        assert_ne!(v.to_string(), SnapshotId::for_name("pvc-1").to_string());
        assert_eq!(VolumeId::parse(&v.to_string()), Some(v));
    }

    #[test]
    fn only_canonical_ids_parse() {
        let v = VolumeId::for_name("a").to_string();
        for bad in [
            "",
            "../etc",
            "/etc",
            "x",
            &v.to_uppercase(),
            &v.replace('-', ""),
            &format!("{v}/.."),
            &format!("{{{v}}}"),
        ] {
            assert_eq!(VolumeId::parse(bad), None, "{bad:?}");
        }
        assert!(matches!(
            VolumeId::parse_existing("../x"),
            Err(Error::NotFound(_))
        ));
        assert!(matches!(
            VolumeId::parse_existing(""),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn names_are_checked() {
        assert!(validate_name("volume", "pvc-1").is_ok());
        assert!(validate_name("volume", &"a".repeat(128)).is_ok());
        assert!(validate_name("volume", &"a".repeat(129)).is_err());
        assert!(validate_name("volume", "").is_err());
        assert!(validate_name("volume", "a\0b").is_err());
    }
}
