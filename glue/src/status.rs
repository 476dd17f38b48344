//! The one mapping of the domain's errors to gRPC statuses, after the error tables
//! of the CSI spec.

use csi_storage::error::SystemFailure;
use csi_storage::Error;
use tonic::{Code, Status};

/// The gRPC code of a domain error.
pub fn code(e: &Error) -> Code {
    match e {
        Error::InvalidArgument(_) => Code::InvalidArgument,
        Error::NotFound(_) => Code::NotFound,
        Error::AlreadyExists(_) => Code::AlreadyExists,
        Error::OutOfRange(_) => Code::OutOfRange,
        Error::ResourceExhausted(_) => Code::ResourceExhausted,
        Error::FailedPrecondition(_) => Code::FailedPrecondition,
        Error::Aborted(_) => Code::Aborted,
        Error::Cancelled(_) => Code::Cancelled,
        Error::StateInUse(_) => Code::FailedPrecondition,
        Error::System { .. } => match e.system_failure() {
            Some(SystemFailure::NoSpace) => Code::ResourceExhausted,
            Some(SystemFailure::Timeout) => Code::DeadlineExceeded,
            _ => Code::Internal,
        },
        // The caller asked for what failed first; the cleanup is in the message.
        Error::Cleanup { first, .. } => code(first),
        Error::Internal(_) => Code::Internal,
    }
}

/// The status of a domain error. The full cause chain goes into the message: an
/// operator reading the sidecar's event sees why, not just that, something failed.
pub fn status(e: Error) -> Status {
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(&e);
    while let Some(s) = src {
        let text = s.to_string();
        if !msg.contains(&text) {
            msg.push_str(": ");
            msg.push_str(&text);
        }
        src = s.source();
    }
    Status::new(code(&e), msg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    use csi_sys::SysError;

    fn system(source: SysError) -> Error {
        Error::System {
            context: "staging pvc-1".into(),
            source,
        }
    }

    fn io_error() -> SysError {
        SysError::Io {
            op: "open",
            path: PathBuf::from("/pool/img"),
            source: std::io::Error::other("bad sector"),
        }
    }

    #[test]
    fn every_error_has_the_code_of_the_spec_tables() {
        let m = || "m".to_string();
        let cases = [
            (Error::InvalidArgument(m()), Code::InvalidArgument),
            (Error::NotFound(m()), Code::NotFound),
            (Error::AlreadyExists(m()), Code::AlreadyExists),
            (Error::OutOfRange(m()), Code::OutOfRange),
            (Error::ResourceExhausted(m()), Code::ResourceExhausted),
            (Error::FailedPrecondition(m()), Code::FailedPrecondition),
            (Error::Aborted(m()), Code::Aborted),
            (Error::Cancelled(m()), Code::Cancelled),
            (Error::StateInUse(m()), Code::FailedPrecondition),
            (Error::Internal(m()), Code::Internal),
            // A full pool or qgroup is the caller's to fix, a hung command a
            // deadline; any other failure of the system layer is internal.
            (
                system(SysError::NoSpace {
                    path: "/pool".into(),
                }),
                Code::ResourceExhausted,
            ),
            (
                system(SysError::Timeout {
                    command: "mkfs.xfs".into(),
                    seconds: 60,
                }),
                Code::DeadlineExceeded,
            ),
            (system(io_error()), Code::Internal),
            (
                system(SysError::Busy {
                    what: "umount".into(),
                }),
                Code::Internal,
            ),
            (
                system(SysError::PermissionDenied {
                    op: "resize2fs".into(),
                    path: "/dev/loop3".into(),
                }),
                Code::Internal,
            ),
        ];
        for (e, want) in cases {
            let text = e.to_string();
            assert_eq!(code(&e), want, "{e:?}");
            let s = status(e);
            assert_eq!(s.code(), want);
            assert!(s.message().starts_with(&text), "{text} -> {}", s.message());
        }
    }

    #[test]
    fn a_failed_cleanup_keeps_the_code_of_the_first_failure_and_both_messages() {
        let cleanup = Error::OutOfRange("too big".into())
            .with_cleanup(Err(Error::Internal("rm failed".into())));
        assert_eq!(code(&cleanup), Code::OutOfRange);
        let nested = Error::Cleanup {
            first: Box::new(cleanup),
            cleanup: Box::new(Error::Aborted("busy".into())),
        };
        assert_eq!(code(&nested), Code::OutOfRange);
        let s = status(nested);
        assert_eq!(s.code(), Code::OutOfRange);
        for part in ["too big", "rm failed", "busy"] {
            assert!(s.message().contains(part), "{part}: {}", s.message());
        }
    }

    #[test]
    fn the_message_carries_the_cause_chain_once() {
        let s = status(system(io_error()));
        assert_eq!(s.code(), Code::Internal);
        assert_eq!(
            s.message().matches("/pool/img").count(),
            1,
            "{}",
            s.message()
        );
        assert!(
            s.message().starts_with("staging pvc-1: open /pool/img")
                && s.message().contains("bad sector"),
            "{}",
            s.message()
        );
    }
}
