//! Unit tests of the controller domain's decisions, on the fake system layer (see
//! `crate::testkit`), one file a subject.

mod create;
mod freeze;
mod list_delete;
mod publish;
mod transfer;
