//! A process's driver: the core and the domains its mode asks for, opened once at
//! start (each domain claiming its part of the state, loading its records,
//! finishing or rolling back what a crash left half-done, removing orphans).

use std::collections::BTreeMap;
use std::ops::Deref;
use std::sync::Arc;

use crate::core::settings::LiveDevices;
use crate::handoff;
use crate::{Config, Controller, Core, Node, Result, System};

pub struct Driver {
    core: Arc<Core>,
    controller: Option<Arc<Controller>>,
    node: Option<Arc<Node>>,
    /// A node plugin beside a controller in another process serves its changes.
    _handoff: Option<handoff::Server>,
}

impl Driver {
    /// Opens the core and the domains of `cfg.controller` and `cfg.node`. The
    /// driver answers Probe as ready only after this returns.
    pub fn open(cfg: Config, sys: System) -> Result<Driver> {
        csi_sys::set_failpoint_hook(crate::core::failpoint::hit);
        let core = Arc::new(Core::open(cfg, sys)?);
        // The controller first: it thaws what a crash left frozen before the node
        // looks at its mounts.
        let controller = match core.cfg.controller {
            true => Some(Arc::new(Controller::open(core.clone())?)),
            false => None,
        };
        let node = match core.cfg.node {
            true => Some(Arc::new(Node::open(core.clone())?)),
            false => None,
        };
        let socket = core.state.handoff_socket();
        let mut served = None;
        match (&controller, &node) {
            (Some(c), Some(n)) => c.set_live_devices(n.clone() as Arc<dyn LiveDevices>),
            (Some(c), None) => c.set_live_devices(Arc::new(handoff::Remote::new(&socket))),
            (None, Some(n)) => {
                served = Some(handoff::Server::start(
                    &socket,
                    n.clone() as Arc<dyn LiveDevices>,
                )?)
            }
            (None, None) => {}
        }
        Ok(Driver {
            core,
            controller,
            node,
            _handoff: served,
        })
    }

    pub fn controller(&self) -> Option<&Arc<Controller>> {
        self.controller.as_ref()
    }

    pub fn node(&self) -> Option<&Arc<Node>> {
        self.node.as_ref()
    }

    /// Probe: ready once state is loaded (the driver exists only then) and while
    /// every pool is still there.
    pub fn probe(&self) -> Result<bool> {
        Ok(self.core.pools_present())
    }

    pub fn volume_count(&self) -> usize {
        self.controller.as_ref().map_or(0, |c| c.volume_count())
    }

    pub fn snapshot_count(&self) -> usize {
        self.controller.as_ref().map_or(0, |c| c.snapshot_count())
    }

    /// Volume and snapshot records per pool (every configured pool, zeros
    /// included), for metrics; zeros without the controller domain.
    pub fn objects_by_pool(&self) -> BTreeMap<String, (usize, usize)> {
        match &self.controller {
            Some(c) => c.objects_by_pool(),
            None => self
                .core
                .pools()
                .map(|p| (p.name.clone(), (0, 0)))
                .collect(),
        }
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        // Transfer threads hold the controller: they end before it does.
        if let Some(c) = &self.controller {
            c.stop_transfers();
        }
    }
}

impl Deref for Driver {
    type Target = Core;
    fn deref(&self) -> &Core {
        &self.core
    }
}

#[cfg(test)]
mod tests;
