//! The tower layer around the gRPC server: counts and times every RPC (when
//! metrics are on), bounds how many non-Identity RPCs run at once, and keeps
//! status messages within bounds.
//!
//! The layer reads the method from the request path and the gRPC code from the
//! `grpc-status` header of a trailers-only response or from the trailers of a
//! normal one, so the handlers know nothing of it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use http_body::{Body, Frame, SizeHint};
use hyper::body::Bytes;

use csi_proto::csi;

use crate::metrics::Metrics;

/// gRPC code names as the Go implementation (and so the CSI sidecars' own
/// metrics) spell them.
const CODE_NAMES: [&str; 17] = [
    "OK",
    "Canceled",
    "Unknown",
    "InvalidArgument",
    "DeadlineExceeded",
    "NotFound",
    "AlreadyExists",
    "PermissionDenied",
    "ResourceExhausted",
    "FailedPrecondition",
    "Aborted",
    "OutOfRange",
    "Unimplemented",
    "Internal",
    "Unavailable",
    "DataLoss",
    "Unauthenticated",
];

fn code_name(code: u32) -> &'static str {
    CODE_NAMES.get(code as usize).copied().unwrap_or("Unknown")
}

/// (service, method) labels of a request path `/csi.v1.Service/Method`: each
/// label is a name of CSI v1.14.0 (`csi::RPCS`) or "other", so a client sending
/// made-up paths cannot grow the label set without bound.
fn rpc_of(path: &str) -> (&'static str, &'static str) {
    let Some((service, method)) = path
        .strip_prefix("/csi.v1.")
        .and_then(|rest| rest.split_once('/'))
    else {
        return ("other", "other");
    };
    let service = csi::RPCS.iter().find(|(s, _)| *s == service).map(|r| r.0);
    let method = csi::RPCS.iter().find(|(_, m)| *m == method).map(|r| r.1);
    match (service, method) {
        (Some(s), Some(m)) => (s, m),
        (Some(s), None) => (s, "other"),
        _ => ("other", "other"),
    }
}

/// Wraps the tonic server: counts and times each RPC (when metrics are on) and
/// lets at most `limit` non-Identity RPCs run at once; the others wait here, as
/// cheap futures, rather than each holding a blocking thread. Identity calls
/// (Probe above all) are never held back, so a liveness check answers under load.
#[derive(Clone)]
pub struct RpcLayer {
    metrics: Option<Arc<Metrics>>,
    limit: Arc<tokio::sync::Semaphore>,
}

impl RpcLayer {
    pub fn new(metrics: Option<Arc<Metrics>>, limit: usize) -> Self {
        RpcLayer {
            metrics,
            limit: Arc::new(tokio::sync::Semaphore::new(limit.max(1))),
        }
    }
}

impl<S> tower::Layer<S> for RpcLayer {
    type Service = RpcService<S>;
    fn layer(&self, inner: S) -> RpcService<S> {
        RpcService {
            inner,
            layer: self.clone(),
        }
    }
}

#[derive(Clone)]
pub struct RpcService<S> {
    inner: S,
    layer: RpcLayer,
}

impl<S, ReqBody, ResBody> tower::Service<http::Request<ReqBody>> for RpcService<S>
where
    S: tower::Service<http::Request<ReqBody>, Response = http::Response<ResBody>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Send + 'static,
    ResBody: Body<Data = Bytes> + Send + 'static,
{
    type Response = http::Response<MeteredBody<ResBody>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<ReqBody>) -> Self::Future {
        // The service that was polled ready is the one to call.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let started = Instant::now();
        let (service, method) = rpc_of(req.uri().path());
        let metrics = self.layer.metrics.clone();
        let limit = (service != "Identity").then(|| self.layer.limit.clone());
        Box::pin(async move {
            let _permit = match limit {
                // The semaphore is never closed; on the impossible error go on unlimited.
                Some(l) => l.acquire_owned().await.ok(),
                None => None,
            };
            let mut rec = Recorder {
                metrics,
                service,
                method,
                started,
                done: false,
            };
            let resp = match inner.call(req).await {
                Ok(r) => r,
                Err(e) => {
                    rec.finish("Unknown");
                    return Err(e);
                }
            };
            let mut resp = resp;
            shorten_message(resp.headers_mut());
            oversized_is_resource_exhausted(resp.headers_mut());
            // Trailers-only responses (every error tonic returns) carry the status
            // in the headers; others in the trailers, seen by the body.
            if let Some(code) = grpc_status(resp.headers()) {
                rec.finish(code_name(code));
            } else if resp.status() != http::StatusCode::OK {
                rec.finish("Unknown");
            }
            Ok(resp.map(|body| MeteredBody {
                inner: Box::pin(body),
                rec,
            }))
        })
    }
}

/// Longest `grpc-message` sent, percent-encoded. Error messages may quote what
/// the client sent (an unknown parameter value); a client whose 3 MiB parameter
/// came back in a header would get a protocol error (HTTP/2 header limits)
/// instead of the status.
const MAX_STATUS_MESSAGE: usize = 2048;

fn shorten_message(headers: &mut http::HeaderMap) {
    let Some(text) = headers
        .get("grpc-message")
        .filter(|v| v.len() > MAX_STATUS_MESSAGE)
        .and_then(|v| v.to_str().ok())
    else {
        return;
    };
    let short = truncate_percent_encoded(text, MAX_STATUS_MESSAGE);
    if let Ok(v) = http::HeaderValue::from_str(&short) {
        headers.insert("grpc-message", v);
    }
}

/// Cuts a percent-encoded UTF-8 string to at most `max` bytes plus a "..." mark,
/// never inside an escape or a multi-byte character.
fn truncate_percent_encoded(text: &str, max: usize) -> String {
    // The encoded length and the decoded byte of the token at `i`.
    let token = |i: usize| -> (usize, u8) {
        let b = text.as_bytes();
        if b[i] == b'%' && i + 3 <= b.len() {
            if let Ok(v) = u8::from_str_radix(&text[i + 1..i + 3], 16) {
                return (3, v);
            }
        }
        (1, b[i])
    };
    let mut cut = 0;
    let mut i = 0;
    while i < text.len() {
        let (len, _) = token(i);
        if i + len > max {
            break;
        }
        i += len;
        // Safe to cut here unless the next byte continues a character.
        if i == text.len() || token(i).1 & 0xC0 != 0x80 {
            cut = i;
        }
    }
    format!("{}...", &text[..cut])
}

/// tonic refuses a request above the size limit with OUT_OF_RANGE; the gRPC
/// status code table (and every other gRPC implementation, so what clients
/// expect) says RESOURCE_EXHAUSTED.
fn oversized_is_resource_exhausted(headers: &mut http::HeaderMap) {
    let oversized = grpc_status(headers) == Some(tonic::Code::OutOfRange as u32)
        && headers
            .get("grpc-message")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|m| {
                m.contains("decoded%20message%20length%20too%20large")
                    || m.contains("decoded message length too large")
            });
    if oversized {
        headers.insert(
            "grpc-status",
            http::HeaderValue::from(tonic::Code::ResourceExhausted as u32),
        );
    }
}

fn grpc_status(headers: &http::HeaderMap) -> Option<u32> {
    headers
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok())
}

struct Recorder {
    metrics: Option<Arc<Metrics>>,
    service: &'static str,
    method: &'static str,
    started: Instant,
    done: bool,
}

impl Recorder {
    fn finish(&mut self, code: &'static str) {
        if self.done {
            return;
        }
        self.done = true;
        if let Some(m) = &self.metrics {
            m.observe(self.service, self.method, code, self.started.elapsed());
        }
    }
}

impl Drop for Recorder {
    /// A call dropped before its status (the client went away) counts as cancelled.
    fn drop(&mut self) {
        self.finish("Canceled");
    }
}

/// A response body that records the call when its trailers pass.
pub struct MeteredBody<B> {
    inner: Pin<Box<B>>,
    rec: Recorder,
}

impl<B: Body<Data = Bytes>> Body for MeteredBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = &mut *self;
        let polled = this.inner.as_mut().poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(code) = frame.trailers_ref().and_then(grpc_status) {
                    this.rec.finish(code_name(code));
                }
            }
            Poll::Ready(Some(Err(_))) => this.rec.finish("Unknown"),
            // A body that ends without a status: the client sees an error.
            Poll::Ready(None) => this.rec.finish("Unknown"),
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn method_labels_are_bounded() {
        assert_eq!(rpc_of("/csi.v1.Identity/Probe"), ("Identity", "Probe"));
        assert_eq!(
            rpc_of("/csi.v1.Controller/CreateVolume"),
            ("Controller", "CreateVolume")
        );
        assert_eq!(rpc_of("/csi.v1.Node/Nope"), ("Node", "other"));
        assert_eq!(rpc_of("/csi.v1.Node/"), ("Node", "other"));
        assert_eq!(rpc_of("/x.y/Probe"), ("other", "other"));
        assert_eq!(rpc_of("/"), ("other", "other"));
        assert_eq!(code_name(0), "OK");
        assert_eq!(code_name(8), "ResourceExhausted");
        assert_eq!(code_name(99), "Unknown");
    }

    #[test]
    fn long_status_messages_are_cut_cleanly() {
        assert_eq!(truncate_percent_encoded("abcdef", 4), "abcd...");
        // "é" is %C3%A9: never split inside the escape or the character.
        assert_eq!(truncate_percent_encoded("a%C3%A9b", 4), "a...");
        assert_eq!(truncate_percent_encoded("a%C3%A9b", 7), "a%C3%A9...");
        assert_eq!(truncate_percent_encoded("ab%25cd", 3), "ab...");
        let mut h = http::HeaderMap::new();
        h.insert(
            "grpc-message",
            http::HeaderValue::from_str(&"x".repeat(10_000)).unwrap(),
        );
        shorten_message(&mut h);
        assert_eq!(h["grpc-message"].len(), MAX_STATUS_MESSAGE + 3);
    }
}
