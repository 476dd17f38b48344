//! The domain's one error type. Its variants follow the error tables of the CSI
//! spec; the glue maps each to its gRPC code, so the domain knows nothing of gRPC.

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
    /// The state cannot be taken by this process: another process holds the
    /// part this one would own, or a later build wrote it in a later format.
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

/// What failed in the system layer, as far as the edge tells failures apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SystemFailure {
    /// The filesystem is full.
    NoSpace,
    /// A command ran past its time.
    Timeout,
    Other,
}

impl Error {
    /// The kind of a failure of the system layer; None for the others.
    pub fn system_failure(&self) -> Option<SystemFailure> {
        match self {
            Error::System { source, .. } => Some(match source {
                SysError::NoSpace { .. } => SystemFailure::NoSpace,
                SysError::Timeout { .. } => SystemFailure::Timeout,
                _ => SystemFailure::Other,
            }),
            _ => None,
        }
    }

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
