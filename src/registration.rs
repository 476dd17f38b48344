//! The kubelet's plugin registration, built in: the `pluginregistration.v1`
//! Registration service on `<drivername>-reg.sock` in the kubelet's
//! plugins_registry directory (`--kubelet-registration-dir`). The kubelet finds
//! the socket, asks who we are (GetInfo: a CSI plugin, the driver's name, the CSI
//! socket's path as the host sees it, the CSI versions), registers the driver and
//! reports the outcome (NotifyRegistrationStatus).
//!
//! A failed registration is logged as an error and the registration socket is
//! made anew after a pause that doubles up to a minute: the kubelet treats the new
//! socket as a new plugin and tries again. The driver itself keeps serving, so
//! running CSI calls (a mount, a copy) are not cut short, as they would be if the
//! whole process exited to be restarted.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{watch, Notify};
use tokio_stream::wrappers::UnixListenerStream;
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status};

use csi_proto::pluginregistration::{
    registration_server::{Registration, RegistrationServer},
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
};

use crate::{authority, endpoint};

/// The CSI versions the kubelet may speak to this driver.
const SUPPORTED_VERSIONS: [&str; 1] = ["1.0.0"];
const FIRST_RETRY: Duration = Duration::from_secs(1);
const LAST_RETRY: Duration = Duration::from_secs(60);
/// How long open connections may finish once the socket is to be made anew or removed.
const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// What the registration serves, and where.
#[derive(Debug, Clone)]
pub struct Config {
    /// The registration socket, in the kubelet's plugins_registry directory.
    pub socket: PathBuf,
    pub driver_name: String,
    /// The CSI socket's path as the kubelet sees it.
    pub endpoint: String,
}

impl Config {
    pub fn new(dir: &Path, driver_name: &str, endpoint: &str) -> Config {
        Config {
            socket: dir.join(format!("{driver_name}-reg.sock")),
            driver_name: driver_name.to_string(),
            endpoint: endpoint.to_string(),
        }
    }
}

struct Service {
    cfg: Config,
    /// Woken when the kubelet reports a failed registration.
    failed: Arc<Notify>,
    /// Woken when it reports success.
    registered: Arc<Notify>,
}

#[tonic::async_trait]
impl Registration for Service {
    async fn get_info(&self, _: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        tracing::info!(name = %self.cfg.driver_name, endpoint = %self.cfg.endpoint,
            "the kubelet asked for the plugin's registration info");
        Ok(Response::new(PluginInfo {
            r#type: "CSIPlugin".into(),
            name: self.cfg.driver_name.clone(),
            endpoint: self.cfg.endpoint.clone(),
            supported_versions: SUPPORTED_VERSIONS.iter().map(|v| v.to_string()).collect(),
        }))
    }

    async fn notify_registration_status(
        &self,
        req: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let status = req.into_inner();
        if status.plugin_registered {
            tracing::info!(name = %self.cfg.driver_name, "registered with the kubelet");
            self.registered.notify_one();
        } else {
            tracing::error!(name = %self.cfg.driver_name, error = %status.error,
                "the kubelet REFUSED the registration; the registration socket will be made \
                 anew so that it tries again");
            self.failed.notify_one();
        }
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}

/// Binds the registration socket, replacing a stale one. Called before the
/// server task starts, so that a bad directory fails the start.
pub fn bind(cfg: &Config) -> Result<tokio::net::UnixListener, String> {
    endpoint::prepare(&cfg.socket)?;
    endpoint::bind(&cfg.socket, None)
        .map_err(|e| format!("cannot listen on {}: {e}", cfg.socket.display()))
}

/// Serves the registration until `stop` turns true, then removes the socket.
pub async fn serve(cfg: Config, first: tokio::net::UnixListener, mut stop: watch::Receiver<bool>) {
    let failed = Arc::new(Notify::new());
    let registered = Arc::new(Notify::new());
    let mut listener = Some(first);
    let mut pause = FIRST_RETRY;
    loop {
        let l = match listener.take() {
            Some(l) => l,
            None => match bind(&cfg) {
                Ok(l) => l,
                Err(e) => {
                    tracing::error!(error = %e, "cannot make the registration socket");
                    if wait_or_stop(&mut stop, pause).await {
                        return;
                    }
                    pause = (pause * 2).min(LAST_RETRY);
                    continue;
                }
            },
        };
        tracing::info!(socket = %cfg.socket.display(), endpoint = %cfg.endpoint,
            "serving the kubelet's plugin registration");
        let service = RegistrationServer::new(Service {
            cfg: cfg.clone(),
            failed: failed.clone(),
            registered: registered.clone(),
        });
        let incoming = UnixListenerStream::new(l).map(|s| s.map(authority::Conn::new));
        let mut stop_serving = stop.clone();
        let refused = failed.clone();
        let closing = Arc::new(Notify::new());
        let closed = closing.clone();
        let ends = async move {
            tokio::select! {
                _ = refused.notified() => {}
                _ = stop_serving.wait_for(|s| *s) => {}
            }
            closed.notify_one();
        };
        let server = tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming_shutdown(incoming, ends);
        tokio::pin!(server);
        // The server ends on a refusal or on stop; a success resets the pause.
        // Open connections get a moment to take their answer, then are cut: a
        // client that keeps its connection must not hold the new socket back.
        let result = loop {
            tokio::select! {
                r = &mut server => break r,
                _ = registered.notified() => pause = FIRST_RETRY,
                _ = closing.notified() => {
                    break tokio::time::timeout(CLOSE_GRACE, &mut server)
                        .await
                        .unwrap_or(Ok(()));
                }
            }
        };
        if let Err(e) = result {
            tracing::error!(error = %e, "the registration server failed");
        }
        let _ = std::fs::remove_file(&cfg.socket);
        if *stop.borrow() {
            tracing::info!(socket = %cfg.socket.display(), "registration socket removed");
            return;
        }
        if wait_or_stop(&mut stop, pause).await {
            return;
        }
        pause = (pause * 2).min(LAST_RETRY);
    }
}

/// Sleeps `pause` unless told to stop first; true when stopping.
async fn wait_or_stop(stop: &mut watch::Receiver<bool>, pause: Duration) -> bool {
    let stopped = tokio::select! {
        _ = tokio::time::sleep(pause) => false,
        _ = stop.wait_for(|s| *s) => true,
    };
    stopped || *stop.borrow()
}
