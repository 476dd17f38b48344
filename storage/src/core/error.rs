//! The domain's one error type and its one mapping to gRPC status codes, following
//! the error tables of the CSI spec.

use csi_sys::SysError;

pub type Result<T> = std::result::Result<T, Error>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A malformed request: missing or invalid fields, unsupported capabilities.
    #[error("{0}")]
    InvalidArgument(String),
    /// The object named by an id does not exist.
    #[error("{0}")]
    NotFound(String),
    /// A name is already used with other arguments.
    #[error("{0}")]
    AlreadyExists(String),
    /// The requested capacity cannot be met.
    #[error("{0}")]
    OutOfRange(String),
    /// The pool has no room, or a node limit is reached.
    #[error("{0}")]
    ResourceExhausted(String),
    /// The object is in a state that does not allow the operation.
    #[error("{0}")]
    FailedPrecondition(String),
    /// Another operation on the same object is in progress, or a pagination token
    /// was not issued by this driver.
    #[error("{0}")]
    Aborted(String),
    /// The caller cancelled the call, or its deadline passed, and the work stopped
    /// at a safe point (see `cancel`). The caller is gone: only the log sees it.
    #[error("{0}")]
    Cancelled(String),
    /// Another process holds the part of the state this one would own.
    #[error("{0}")]
    StateInUse(String),
    /// A failure of the system layer, with what the domain was doing.
    #[error("{context}: {source}")]
    System {
        context: String,
        #[source]
        source: SysError,
    },
    /// A failure during cleanup after another failure: both are kept.
    #[error("{first}; cleanup after it also failed: {cleanup}")]
    Cleanup {
        first: Box<Error>,
        cleanup: Box<Error>,
    },
    /// Anything else that went wrong inside the driver.
    #[error("{0}")]
    Internal(String),
}

impl Error {
    pub fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(msg.into())
    }
    pub fn not_found(msg: impl Into<String>) -> Self {
        Error::NotFound(msg.into())
    }
    pub fn precondition(msg: impl Into<String>) -> Self {
        Error::FailedPrecondition(msg.into())
    }
    pub fn internal(msg: impl Into<String>) -> Self {
        Error::Internal(msg.into())
    }

    /// This error, joined by the failure of the cleanup that followed it, if any.
    pub fn with_cleanup(self, cleanup: Result<()>) -> Error {
        match cleanup {
            Ok(()) => self,
            Err(c) => Error::Cleanup {
                first: Box::new(self),
                cleanup: Box::new(c),
            },
        }
    }

    /// The gRPC code this error maps to.
    pub fn code(&self) -> tonic::Code {
        use tonic::Code;
        match self {
            Error::InvalidArgument(_) => Code::InvalidArgument,
            Error::NotFound(_) => Code::NotFound,
            Error::AlreadyExists(_) => Code::AlreadyExists,
            Error::OutOfRange(_) => Code::OutOfRange,
            Error::ResourceExhausted(_) => Code::ResourceExhausted,
            Error::FailedPrecondition(_) => Code::FailedPrecondition,
            Error::Aborted(_) => Code::Aborted,
            Error::Cancelled(_) => Code::Cancelled,
            Error::StateInUse(_) => Code::FailedPrecondition,
            Error::System { source, .. } => match source {
                SysError::NoSpace { .. } => Code::ResourceExhausted,
                SysError::Timeout { .. } => Code::DeadlineExceeded,
                _ => Code::Internal,
            },
            Error::Cleanup { first, .. } => first.code(),
            Error::Internal(_) => Code::Internal,
        }
    }
}

/// Adds what the domain was doing to a system-layer error.
pub trait Context<T> {
    fn context(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T> Context<T> for std::result::Result<T, SysError> {
    fn context(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|source| Error::System {
            context: what(),
            source,
        })
    }
}

impl From<Error> for tonic::Status {
    fn from(e: Error) -> Self {
        // The full cause chain goes into the message: an operator reading the
        // sidecar's event sees why, not just that, something failed.
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
        tonic::Status::new(e.code(), msg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_follow_the_spec_tables() {
        assert_eq!(Error::invalid("x").code(), tonic::Code::InvalidArgument);
        assert_eq!(Error::not_found("x").code(), tonic::Code::NotFound);
        assert_eq!(
            Error::AlreadyExists("x".into()).code(),
            tonic::Code::AlreadyExists
        );
        assert_eq!(Error::Aborted("x".into()).code(), tonic::Code::Aborted);
        let cleanup = Error::Cleanup {
            first: Box::new(Error::OutOfRange("big".into())),
            cleanup: Box::new(Error::internal("rm failed")),
        };
        assert_eq!(cleanup.code(), tonic::Code::OutOfRange);
        let status: tonic::Status = cleanup.into();
        assert!(status.message().contains("big") && status.message().contains("rm failed"));
    }
}
