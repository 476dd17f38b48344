//! Extended attributes on pool files. A volume's mutable attributes (direct I/O,
//! read-ahead) are kept on its image file, so the node finds the current values at
//! stage time whichever process changed them.

use std::io;
use std::path::Path;

use crate::error::{Result, SysError};
use crate::fsrecord::{note, FsOp};

/// The full name `user.<name>`; a NUL byte in `name` (or in `path`) cannot reach
/// the kernel and is refused with a clear error.
fn full_name(path: &Path, name: &str) -> Result<String> {
    if name.contains('\0') {
        return Err(SysError::InvalidArgument {
            what: format!(
                "extended attribute name {name:?} of {} contains a NUL byte",
                path.display()
            ),
        });
    }
    crate::file::check_path(path)?;
    Ok(format!("user.{name}"))
}

fn io_err(op: &'static str, path: &Path, source: io::Error) -> SysError {
    SysError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// Sets `user.<name>` on `path` (not following symlinks).
pub fn set(path: &Path, name: &str, value: &[u8]) -> Result<()> {
    let full = full_name(path, name)?;
    xattr::set(path, &full, value).map_err(|e| io_err("setxattr", path, e))?;
    note(|| FsOp::SetXattr {
        path: path.into(),
        name: name.into(),
        value: value.to_vec(),
    });
    Ok(())
}

/// Reads `user.<name>` of `path` (not following symlinks); None when it is not set.
pub fn get(path: &Path, name: &str) -> Result<Option<Vec<u8>>> {
    let full = full_name(path, name)?;
    xattr::get(path, &full).map_err(|e| io_err("getxattr", path, e))
}

/// Removes `user.<name>` (not following symlinks); absent is fine.
pub fn remove(path: &Path, name: &str) -> Result<()> {
    let full = full_name(path, name)?;
    match xattr::remove(path, &full) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::ENODATA) => return Ok(()),
        Err(e) => return Err(io_err("removexattr", path, e)),
    }
    note(|| FsOp::RemoveXattr {
        path: path.into(),
        name: name.into(),
    });
    Ok(())
}

/// The names of the `user.` attributes of `path`, without the prefix.
pub fn list_user(path: &Path) -> Result<Vec<String>> {
    crate::file::check_path(path)?;
    let names = xattr::list(path).map_err(|e| io_err("listxattr", path, e))?;
    Ok(names
        .filter_map(|n| n.to_str()?.strip_prefix("user.").map(str::to_string))
        .collect())
}

#[cfg(test)]
mod tests {
    #[test]
    fn set_get_remove_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("img");
        std::fs::write(&f, b"").unwrap();
        assert_eq!(super::get(&f, "example-csi.t").unwrap(), None);
        super::set(&f, "example-csi.t", b"true").unwrap();
        assert_eq!(
            super::get(&f, "example-csi.t").unwrap().as_deref(),
            Some(&b"true"[..])
        );
        assert_eq!(super::list_user(&f).unwrap(), vec!["example-csi.t"]);
        super::remove(&f, "example-csi.t").unwrap();
        assert_eq!(super::get(&f, "example-csi.t").unwrap(), None);
        super::remove(&f, "example-csi.t").unwrap();
    }

    #[test]
    fn a_nul_byte_in_a_name_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("img");
        std::fs::write(&f, b"").unwrap();
        for err in [
            super::set(&f, "a\0b", b"1").unwrap_err(),
            super::get(&f, "a\0b").unwrap_err(),
            super::remove(&f, "a\0b").unwrap_err(),
        ] {
            assert!(err.is_invalid_argument(), "{err}");
            assert!(err.to_string().contains("NUL byte"), "{err}");
        }
    }
}
