//! Unit tests of the driver's decisions across its domains, on the fake system layer (see
//! `crate::testkit`), one file a subject.

mod restart;
mod two_processes;
