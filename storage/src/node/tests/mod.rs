//! Unit tests of the node domain's decisions, on the fake system layer (see
//! `crate::testkit`), one file a subject.

mod expand;
mod live_settings;
mod recovery;
mod stage_publish;
