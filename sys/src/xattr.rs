//! Extended attributes on pool files. A volume's mutable attributes (direct I/O,
//! read-ahead) are kept on its image file, so the node finds the current values at
//! stage time whichever process changed them.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::error::{Result, SysError};
use crate::fsrecord::{note, FsOp};

fn cpath(path: &Path) -> Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| SysError::Io {
        op: "xattr",
        path: path.to_path_buf(),
        source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "path contains NUL"),
    })
}

fn io_err(op: &'static str, path: &Path) -> SysError {
    SysError::Io {
        op,
        path: path.to_path_buf(),
        source: std::io::Error::last_os_error(),
    }
}

/// Sets `user.<name>` on `path` (not following symlinks).
pub fn set(path: &Path, name: &str, value: &[u8]) -> Result<()> {
    let p = cpath(path)?;
    let n = CString::new(format!("user.{name}")).map_err(|_| io_err("setxattr", path))?;
    // SAFETY: p and n are valid NUL-terminated strings; value is a valid slice.
    let rc = unsafe {
        libc::lsetxattr(
            p.as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    if rc != 0 {
        return Err(io_err("setxattr", path));
    }
    note(|| FsOp::SetXattr {
        path: path.into(),
        name: name.into(),
        value: value.to_vec(),
    });
    Ok(())
}

/// Reads `user.<name>` of `path`; None when it is not set.
pub fn get(path: &Path, name: &str) -> Result<Option<Vec<u8>>> {
    let p = cpath(path)?;
    let n = CString::new(format!("user.{name}")).map_err(|_| io_err("getxattr", path))?;
    let mut buf = vec![0u8; 4096];
    // SAFETY: buf is writable for buf.len() bytes; p and n are NUL-terminated.
    let rc = unsafe { libc::lgetxattr(p.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if rc < 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::ENODATA) {
            return Ok(None);
        }
        return Err(SysError::Io {
            op: "getxattr",
            path: path.to_path_buf(),
            source: err,
        });
    }
    buf.truncate(rc as usize);
    Ok(Some(buf))
}

/// Removes `user.<name>`; absent is fine.
pub fn remove(path: &Path, name: &str) -> Result<()> {
    let p = cpath(path)?;
    let n = CString::new(format!("user.{name}")).map_err(|_| io_err("removexattr", path))?;
    // SAFETY: p and n are valid NUL-terminated strings.
    let rc = unsafe { libc::lremovexattr(p.as_ptr(), n.as_ptr()) };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::ENODATA) {
            return Ok(());
        }
        return Err(SysError::Io {
            op: "removexattr",
            path: path.to_path_buf(),
            source: err,
        });
    }
    note(|| FsOp::RemoveXattr {
        path: path.into(),
        name: name.into(),
    });
    Ok(())
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
        super::remove(&f, "example-csi.t").unwrap();
        assert_eq!(super::get(&f, "example-csi.t").unwrap(), None);
    }
}
