//! Load on a driver's metrics port while the scenarios run: `--metrics-hammer
//! HOST:PORT` keeps `--metrics-hammer-connections` clients each opening a
//! connection, asking GET /metrics and reading the answer, again and again, so
//! that the CSI calls' figures show what scrapes cost them.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The running clients and what they saw.
pub struct Hammer {
    stop: Arc<AtomicBool>,
    answered: Arc<AtomicU64>,
    refused: Arc<AtomicU64>,
    thread: std::thread::JoinHandle<()>,
}

impl Hammer {
    pub fn start(address: &str, clients: usize) -> Hammer {
        let stop = Arc::new(AtomicBool::new(false));
        let answered = Arc::new(AtomicU64::new(0));
        let refused = Arc::new(AtomicU64::new(0));
        let (address, flag) = (address.to_string(), stop.clone());
        let (ok, no) = (answered.clone(), refused.clone());
        // A runtime of its own, so that the clients do not delay the
        // measuring one's timers.
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime for the metrics hammer");
            rt.block_on(async move {
                let tasks: Vec<_> = (0..clients)
                    .map(|_| {
                        let (address, stop) = (address.clone(), flag.clone());
                        let (answered, refused) = (ok.clone(), no.clone());
                        tokio::spawn(async move {
                            while !stop.load(Ordering::Relaxed) {
                                let got =
                                    tokio::time::timeout(Duration::from_secs(10), scrape(&address));
                                match got.await {
                                    Ok(Ok(true)) => answered.fetch_add(1, Ordering::Relaxed),
                                    _ => refused.fetch_add(1, Ordering::Relaxed),
                                };
                            }
                        })
                    })
                    .collect();
                for t in tasks {
                    let _ = t.await;
                }
            })
        });
        Hammer {
            stop,
            answered,
            refused,
            thread,
        }
    }

    /// Stops the clients: (scrapes answered 200, connections refused or failed).
    pub async fn stop(self) -> (u64, u64) {
        let (answered, refused) = (self.answered.clone(), self.refused.clone());
        self.stop.store(true, Ordering::Relaxed);
        let _ = tokio::task::spawn_blocking(move || self.thread.join()).await;
        (
            answered.load(Ordering::Relaxed),
            refused.load(Ordering::Relaxed),
        )
    }
}

/// One GET /metrics on a new connection: whether it was answered 200.
async fn scrape(address: &str) -> std::io::Result<bool> {
    let mut conn = tokio::net::TcpStream::connect(address).await?;
    conn.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").await?;
    let mut answer = Vec::new();
    conn.read_to_end(&mut answer).await?;
    Ok(answer.starts_with(b"HTTP/1.0 200") || answer.starts_with(b"HTTP/1.1 200"))
}
