//! Connections on the Unix socket, made acceptable to h2 whatever `:authority`
//! the client sends.
//!
//! gRPC clients built on grpc C-core (Python, C++, Ruby, PHP) and grpc-java name
//! a Unix socket's path as the request's `:authority` (`/csi/csi.sock`, or its
//! percent-encoded form). That is not an RFC 3986 authority, and h2 resets every
//! such stream with PROTOCOL_ERROR before tonic sees it. On a Unix socket the
//! authority carries nothing (the socket is the peer), so this reader replaces a
//! malformed `:authority` value, in the HPACK-coded header blocks as they arrive,
//! with one h2 accepts. Everything else passes through byte for byte.
//!
//! The replacement has exactly the length of the original. HPACK sizes its
//! dynamic table by the decoded lengths of names and values, so the client's
//! table and h2's evict the same entries and every later index still points at
//! the same field; only the `:authority` entry itself differs, and a later
//! reference to it yields the replacement. To find the fields, this reader keeps
//! its own copy of that table (names' and values' lengths, and whether a name is
//! `:authority`) for the connection. On anything it cannot follow it stops
//! rewriting and passes the rest unchanged, leaving the verdict to h2.

use std::collections::VecDeque;
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::UnixStream;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEADER: usize = 9;
const TYPE_HEADERS: u8 = 0x1;
const TYPE_CONTINUATION: u8 = 0x9;
const FLAG_END_STREAM: u8 = 0x1;
const FLAG_END_HEADERS: u8 = 0x4;
const FLAG_PADDED: u8 = 0x8;
const FLAG_PRIORITY: u8 = 0x20;
/// The smallest SETTINGS_MAX_FRAME_SIZE a peer may have, and the one the server
/// announces: a frame this reader writes is never larger.
const MAX_FRAME: usize = 16_384;
/// A header block held back longer than this is passed on untouched: the server
/// refuses header lists above 16 KiB decoded anyway, and HPACK never codes a
/// field in more bytes than it decodes to (plus a few).
const MAX_BLOCK: usize = 64 * 1024;
/// The dynamic table's size until the client changes it (SETTINGS_HEADER_TABLE_SIZE
/// default; the server announces no other).
const DEFAULT_TABLE_SIZE: usize = 4096;

/// Name lengths of the HPACK static table (RFC 7541, appendix A), index 1 first;
/// index 1 is `:authority`.
const STATIC_NAMES: [&str; 61] = [
    ":authority",
    ":method",
    ":method",
    ":path",
    ":path",
    ":scheme",
    ":scheme",
    ":status",
    ":status",
    ":status",
    ":status",
    ":status",
    ":status",
    ":status",
    "accept-charset",
    "accept-encoding",
    "accept-language",
    "accept-ranges",
    "accept",
    "access-control-allow-origin",
    "age",
    "allow",
    "authorization",
    "cache-control",
    "content-disposition",
    "content-encoding",
    "content-language",
    "content-length",
    "content-location",
    "content-range",
    "content-type",
    "cookie",
    "date",
    "etag",
    "expect",
    "expires",
    "from",
    "host",
    "if-match",
    "if-modified-since",
    "if-none-match",
    "if-range",
    "if-unmodified-since",
    "last-modified",
    "link",
    "location",
    "max-forwards",
    "proxy-authenticate",
    "proxy-authorization",
    "range",
    "referer",
    "refresh",
    "retry-after",
    "server",
    "set-cookie",
    "strict-transport-security",
    "transfer-encoding",
    "user-agent",
    "vary",
    "via",
    "www-authenticate",
];

/// Why a header block could not be followed.
#[derive(Debug, PartialEq, Eq)]
struct Malformed;

/// An entry of the dynamic table, as far as this reader needs it.
struct Entry {
    name_len: usize,
    size: usize,
    authority: bool,
}

/// This connection's view of the decoder's dynamic table.
struct Table {
    entries: VecDeque<Entry>,
    size: usize,
    max: usize,
}

impl Table {
    fn new() -> Table {
        Table {
            entries: VecDeque::new(),
            size: 0,
            max: DEFAULT_TABLE_SIZE,
        }
    }

    fn resize(&mut self, max: usize) {
        self.max = max;
        self.evict(0);
    }

    fn evict(&mut self, room: usize) {
        while self.size + room > self.max {
            match self.entries.pop_back() {
                Some(e) => self.size -= e.size,
                None => break,
            }
        }
    }

    fn insert(&mut self, name_len: usize, value_len: usize, authority: bool) {
        let size = name_len + value_len + 32;
        if size > self.max {
            self.entries.clear();
            self.size = 0;
            return;
        }
        self.evict(size);
        self.size += size;
        self.entries.push_front(Entry {
            name_len,
            size,
            authority,
        });
    }

    /// (name length, is `:authority`) of the field at `index`.
    fn name(&self, index: usize) -> Result<(usize, bool), Malformed> {
        match index {
            0 => Err(Malformed),
            1..=61 => Ok((STATIC_NAMES[index - 1].len(), index == 1)),
            _ => self
                .entries
                .get(index - 62)
                .map(|e| (e.name_len, e.authority))
                .ok_or(Malformed),
        }
    }

    fn decode(&self, s: HpackString<'_>) -> Result<Vec<u8>, Malformed> {
        if s.huffman {
            crate::huffman::decode(s.bytes).map_err(|_| Malformed)
        } else {
            Ok(s.bytes.to_vec())
        }
    }

    /// Walks one header block, keeping the table in step. Returns the block with
    /// every malformed `:authority` value replaced, or None when none was.
    fn rewrite(&mut self, block: &[u8]) -> Result<Option<Vec<u8>>, Malformed> {
        let mut out = Vec::with_capacity(block.len() + 16);
        let mut changed = false;
        let mut i = 0;
        while i < block.len() {
            let start = i;
            let first = block[i];
            if first & 0x80 != 0 {
                // Indexed field: the table is not changed.
                if integer(block, &mut i, 7)? == 0 {
                    return Err(Malformed);
                }
                out.extend_from_slice(&block[start..i]);
                continue;
            }
            if first & 0xE0 == 0x20 {
                let max = integer(block, &mut i, 5)?;
                self.resize(max);
                out.extend_from_slice(&block[start..i]);
                continue;
            }
            // A literal: with incremental indexing (01), without (0000) or never
            // indexed (0001).
            let indexed = first & 0xC0 == 0x40;
            let name_index = integer(block, &mut i, if indexed { 6 } else { 4 })?;
            let (name_len, authority) = if name_index == 0 {
                let name = string(block, &mut i)?;
                let name = self.decode(name)?;
                (name.len(), name == b":authority")
            } else {
                self.name(name_index)?
            };
            let value_at = i;
            let value = string(block, &mut i)?;
            let mut value_len = value.bytes.len();
            if indexed || authority {
                let decoded = self.decode(value)?;
                value_len = decoded.len();
                if authority && needs_replacing(&decoded) {
                    out.extend_from_slice(&block[start..value_at]);
                    put_string(&mut out, &replacement(&decoded));
                    changed = true;
                } else {
                    out.extend_from_slice(&block[start..i]);
                }
            } else {
                out.extend_from_slice(&block[start..i]);
            }
            if indexed {
                self.insert(name_len, value_len, authority);
            }
        }
        Ok(changed.then_some(out))
    }
}

/// h2 refuses exactly what `http` cannot parse as an authority. An empty value
/// cannot be given a replacement of the same length; h2 judges it.
fn needs_replacing(value: &[u8]) -> bool {
    !value.is_empty() && http::uri::Authority::try_from(value).is_err()
}

/// A registered name of the same length: letters, digits and `-._~` are kept,
/// every other byte becomes `_` (`/csi/csi.sock` reads `_csi_csi.sock`).
fn replacement(value: &[u8]) -> Vec<u8> {
    value
        .iter()
        .map(|&c| {
            if c.is_ascii_alphanumeric() || b"-._~".contains(&c) {
                c
            } else {
                b'_'
            }
        })
        .collect()
}

/// An HPACK integer with an `n`-bit prefix (RFC 7541, 5.1).
fn integer(buf: &[u8], i: &mut usize, n: u8) -> Result<usize, Malformed> {
    let mask = (1usize << n) - 1;
    let mut value = usize::from(*buf.get(*i).ok_or(Malformed)?) & mask;
    *i += 1;
    if value < mask {
        return Ok(value);
    }
    let mut shift = 0;
    loop {
        let b = *buf.get(*i).ok_or(Malformed)?;
        *i += 1;
        // Nothing in a header block of at most MAX_BLOCK bytes needs more.
        if shift > 21 {
            return Err(Malformed);
        }
        value += usize::from(b & 0x7F) << shift;
        shift += 7;
        if b & 0x80 == 0 {
            return Ok(value);
        }
    }
}

#[derive(Clone, Copy)]
struct HpackString<'a> {
    huffman: bool,
    bytes: &'a [u8],
}

fn string<'a>(buf: &'a [u8], i: &mut usize) -> Result<HpackString<'a>, Malformed> {
    let huffman = buf.get(*i).ok_or(Malformed)? & 0x80 != 0;
    let len = integer(buf, i, 7)?;
    let bytes = buf.get(*i..*i + len).ok_or(Malformed)?;
    *i += len;
    Ok(HpackString { huffman, bytes })
}

/// A string literal without Huffman coding.
fn put_string(out: &mut Vec<u8>, s: &[u8]) {
    let mut len = s.len();
    if len < 0x7F {
        out.push(len as u8);
    } else {
        out.push(0x7F);
        len -= 0x7F;
        while len >= 0x80 {
            out.push((len & 0x7F) as u8 | 0x80);
            len >>= 7;
        }
        out.push(len as u8);
    }
    out.extend_from_slice(s);
}

fn frame_header(out: &mut Vec<u8>, len: usize, kind: u8, flags: u8, stream: [u8; 4]) {
    out.extend_from_slice(&(len as u32).to_be_bytes()[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&stream);
}

/// A header block being gathered from a HEADERS frame and its CONTINUATIONs.
struct Block {
    /// The frames as received, sent on unchanged when nothing is replaced.
    raw: Vec<u8>,
    fragment: Vec<u8>,
    stream: [u8; 4],
    flags: u8,
    priority: Option<[u8; 5]>,
}

enum State {
    /// Bytes of the connection preface matched so far.
    Preface(usize),
    /// Gathering a frame header, or a whole HEADERS or CONTINUATION frame, in `partial`.
    Frame,
    /// Payload bytes of another frame still to pass on.
    Payload(usize),
    /// Not rewriting any more.
    Passthrough,
}

/// The inbound byte stream of one connection, with `:authority` values fixed.
pub struct Rewriter {
    state: State,
    partial: Vec<u8>,
    block: Option<Block>,
    table: Table,
    rewritten: u64,
}

impl Default for Rewriter {
    fn default() -> Self {
        Rewriter {
            state: State::Preface(0),
            partial: Vec::new(),
            block: None,
            table: Table::new(),
            rewritten: 0,
        }
    }
}

impl Rewriter {
    /// How many header blocks had their `:authority` replaced.
    pub fn rewritten(&self) -> u64 {
        self.rewritten
    }

    /// Takes bytes read from the client; appends what may go on to `out`.
    pub fn feed(&mut self, mut input: &[u8], out: &mut Vec<u8>) {
        while !input.is_empty() {
            match &mut self.state {
                State::Passthrough => {
                    out.extend_from_slice(input);
                    return;
                }
                State::Preface(seen) => {
                    let want = &PREFACE[*seen..];
                    let n = want.len().min(input.len());
                    if input[..n] != want[..n] {
                        self.state = State::Passthrough;
                        continue;
                    }
                    out.extend_from_slice(&input[..n]);
                    input = &input[n..];
                    *seen += n;
                    if *seen == PREFACE.len() {
                        self.state = State::Frame;
                    }
                }
                State::Payload(left) => {
                    let n = (*left).min(input.len());
                    out.extend_from_slice(&input[..n]);
                    input = &input[n..];
                    *left -= n;
                    if *left == 0 {
                        self.state = State::Frame;
                    }
                }
                State::Frame => {
                    let need = if self.partial.len() < FRAME_HEADER {
                        FRAME_HEADER
                    } else {
                        FRAME_HEADER + payload_len(&self.partial)
                    };
                    let n = (need - self.partial.len()).min(input.len());
                    self.partial.extend_from_slice(&input[..n]);
                    input = &input[n..];
                    if self.partial.len() == need {
                        self.frame(out);
                    }
                }
            }
        }
    }

    /// Called at the end of the input: whatever is held goes on as it came.
    pub fn finish(&mut self, out: &mut Vec<u8>) {
        self.give_up(out);
    }

    fn give_up(&mut self, out: &mut Vec<u8>) {
        if let Some(b) = self.block.take() {
            out.extend_from_slice(&b.raw);
        }
        out.append(&mut self.partial);
        self.state = State::Passthrough;
    }

    /// `partial` holds a frame header, or a whole frame whose header said to gather it.
    fn frame(&mut self, out: &mut Vec<u8>) {
        let len = payload_len(&self.partial);
        let kind = self.partial[3];
        let gather = kind == TYPE_HEADERS || (kind == TYPE_CONTINUATION && self.block.is_some());
        if self.partial.len() == FRAME_HEADER && len > 0 {
            if !gather {
                out.append(&mut self.partial);
                self.state = State::Payload(len);
                return;
            }
            if len > MAX_FRAME {
                self.give_up(out);
            }
            // Otherwise wait for the payload.
            return;
        }
        if !gather {
            // A frame without payload.
            if self.block.is_some() {
                // Only CONTINUATION may follow an unfinished header block.
                self.give_up(out);
                return;
            }
            out.append(&mut self.partial);
            return;
        }
        let frame = std::mem::take(&mut self.partial);
        let flags = frame[4];
        let stream: [u8; 4] = frame[5..9].try_into().expect("9-byte frame header");
        let payload = &frame[FRAME_HEADER..];
        if kind == TYPE_HEADERS {
            if self.block.is_some() {
                self.partial = frame;
                self.give_up(out);
                return;
            }
            let Some((priority, fragment)) = headers_payload(flags, payload) else {
                self.partial = frame;
                self.give_up(out);
                return;
            };
            self.block = Some(Block {
                fragment: fragment.to_vec(),
                raw: frame.clone(),
                stream,
                flags,
                priority,
            });
        } else {
            let block = self.block.as_mut().expect("gathering a block");
            if block.stream != stream || block.raw.len() + frame.len() > MAX_BLOCK {
                self.partial = frame;
                self.give_up(out);
                return;
            }
            block.fragment.extend_from_slice(payload);
            block.raw.extend_from_slice(&frame);
        }
        if flags & FLAG_END_HEADERS != 0 {
            let block = self.block.take().expect("a block");
            self.finish_block(block, out);
        }
    }

    fn finish_block(&mut self, block: Block, out: &mut Vec<u8>) {
        match self.table.rewrite(&block.fragment) {
            Ok(None) => out.extend_from_slice(&block.raw),
            Ok(Some(fragment)) => {
                self.rewritten += 1;
                write_block(out, &block, &fragment);
            }
            Err(Malformed) => {
                out.extend_from_slice(&block.raw);
                self.state = State::Passthrough;
            }
        }
    }
}

fn payload_len(header: &[u8]) -> usize {
    (usize::from(header[0]) << 16) | (usize::from(header[1]) << 8) | usize::from(header[2])
}

/// The priority fields and the header block fragment of a HEADERS payload.
fn headers_payload(flags: u8, payload: &[u8]) -> Option<(Option<[u8; 5]>, &[u8])> {
    let mut p = payload;
    let mut pad = 0;
    if flags & FLAG_PADDED != 0 {
        pad = usize::from(*p.first()?);
        p = &p[1..];
    }
    let mut priority = None;
    if flags & FLAG_PRIORITY != 0 {
        priority = Some(p.get(..5)?.try_into().ok()?);
        p = &p[5..];
    }
    let end = p.len().checked_sub(pad)?;
    Some((priority, &p[..end]))
}

/// A HEADERS frame and as many CONTINUATIONs as the block needs, without padding.
fn write_block(out: &mut Vec<u8>, block: &Block, fragment: &[u8]) {
    let prio_len = block.priority.map_or(0, |_| 5);
    let first = fragment.len().min(MAX_FRAME - prio_len);
    let (head, mut rest) = fragment.split_at(first);
    let mut flags = block.flags & (FLAG_END_STREAM | FLAG_PRIORITY);
    if rest.is_empty() {
        flags |= FLAG_END_HEADERS;
    }
    frame_header(
        out,
        prio_len + head.len(),
        TYPE_HEADERS,
        flags,
        block.stream,
    );
    if let Some(p) = block.priority {
        out.extend_from_slice(&p);
    }
    out.extend_from_slice(head);
    while !rest.is_empty() {
        let n = rest.len().min(MAX_FRAME);
        let (chunk, tail) = rest.split_at(n);
        rest = tail;
        let flags = if rest.is_empty() { FLAG_END_HEADERS } else { 0 };
        frame_header(out, n, TYPE_CONTINUATION, flags, block.stream);
        out.extend_from_slice(chunk);
    }
}

/// A Unix-socket connection whose inbound bytes pass through a [`Rewriter`].
pub struct Conn {
    inner: UnixStream,
    rewriter: Rewriter,
    ready: Vec<u8>,
    at: usize,
    scratch: Box<[u8]>,
    eof: bool,
    logged: bool,
}

impl Conn {
    pub fn new(inner: UnixStream) -> Conn {
        Conn {
            inner,
            rewriter: Rewriter::default(),
            ready: Vec::new(),
            at: 0,
            scratch: vec![0; 16 * 1024].into_boxed_slice(),
            eof: false,
            logged: false,
        }
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.at < this.ready.len() {
                let n = (this.ready.len() - this.at).min(buf.remaining());
                buf.put_slice(&this.ready[this.at..this.at + n]);
                this.at += n;
                if this.at == this.ready.len() {
                    this.ready.clear();
                    this.at = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                // Whatever was held goes on; then end of stream.
                this.rewriter.finish(&mut this.ready);
                if this.ready.is_empty() {
                    return Poll::Ready(Ok(()));
                }
                continue;
            }
            let mut rb = ReadBuf::new(&mut this.scratch);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut rb))?;
            if rb.filled().is_empty() {
                this.eof = true;
                continue;
            }
            let n = rb.filled().len();
            this.rewriter.feed(&this.scratch[..n], &mut this.ready);
            if !this.logged && this.rewriter.rewritten() > 0 {
                this.logged = true;
                tracing::debug!(
                    "a client named the socket path as :authority; replaced with a valid name"
                );
            }
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for Conn {
    type ConnectInfo = <UnixStream as tonic::transport::server::Connected>::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests;
