use super::*;

/// A literal with incremental indexing of a static name, raw value.
fn lit_indexed(name_index: u8, value: &[u8]) -> Vec<u8> {
    let mut v = vec![0x40 | name_index];
    put_string(&mut v, value);
    v
}

fn headers_frame(flags: u8, stream: u32, fragment: &[u8]) -> Vec<u8> {
    let mut v = Vec::new();
    frame_header(
        &mut v,
        fragment.len(),
        TYPE_HEADERS,
        flags,
        stream.to_be_bytes(),
    );
    v.extend_from_slice(fragment);
    v
}

/// A request as h2 read it: :authority, :path and the other fields.
type Served = (String, String, Vec<(String, String)>);

/// The requests h2's own server (the one tonic serves with) reads from
/// the rewriter's output: a client SETTINGS frame goes in after the preface,
/// then the frames. Each request's :authority, :path and other fields, for
/// the first `n` requests (fewer if h2 refuses the rest).
fn served(out: &[u8], n: usize) -> Vec<Served> {
    let mut input = PREFACE.to_vec();
    frame_header(&mut input, 0, 0x4, 0, [0; 4]);
    input.extend_from_slice(&out[PREFACE.len()..]);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut client, server) = tokio::io::duplex(1 << 20);
        client.write_all(&input).await.unwrap();
        // The server's own frames are read and dropped; the client stays open.
        tokio::spawn(async move {
            let mut sink = vec![0; 4096];
            while client.read(&mut sink).await.is_ok_and(|n| n > 0) {}
        });
        let mut conn = h2::server::handshake(server).await.unwrap();
        let mut got = Vec::new();
        let wait = std::time::Duration::from_secs(5);
        while got.len() < n {
            let Ok(Some(req)) = tokio::time::timeout(wait, conn.accept()).await else {
                break;
            };
            let (req, _) = req.expect("h2 accepts the request");
            let uri = req.uri();
            let fields = req
                .headers()
                .iter()
                .map(|(n, v)| (n.to_string(), String::from_utf8_lossy(v.as_bytes()).into()))
                .collect();
            got.push((
                uri.authority().map(|a| a.to_string()).unwrap_or_default(),
                uri.path().to_string(),
                fields,
            ));
        }
        got
    })
}

/// Feeds `input` one byte at a time (the worst split) and in one piece; both
/// must give the same output.
fn run(input: &[u8]) -> Vec<u8> {
    let mut whole = Vec::new();
    let mut r = Rewriter::default();
    r.feed(input, &mut whole);
    r.finish(&mut whole);
    let mut bytewise = Vec::new();
    let mut r = Rewriter::default();
    for b in input {
        r.feed(std::slice::from_ref(b), &mut bytewise);
    }
    r.finish(&mut bytewise);
    assert_eq!(
        whole, bytewise,
        "the output does not depend on how reads split"
    );
    whole
}

/// Splits the rewriter's output into (type, flags, payload) frames after the preface.
fn frames(out: &[u8]) -> Vec<(u8, u8, Vec<u8>)> {
    assert!(out.starts_with(PREFACE));
    let mut p = &out[PREFACE.len()..];
    let mut v = Vec::new();
    while !p.is_empty() {
        let len = payload_len(p);
        v.push((p[3], p[4], p[9..9 + len].to_vec()));
        p = &p[9 + len..];
    }
    v
}

#[test]
fn the_replacement_is_a_valid_authority_of_the_same_length() {
    for bad in [
        &b"/csi/csi.sock"[..],
        b"%2Fvar%2Flib%2Fkubelet%2Fplugins%2Fx%2Fcsi.sock",
        b"unix:/tmp/a b@c:[d]",
        b"/",
    ] {
        assert!(needs_replacing(bad), "{bad:?}");
        let r = replacement(bad);
        assert_eq!(r.len(), bad.len());
        assert!(http::uri::Authority::try_from(&r[..]).is_ok(), "{r:?}");
    }
    for good in [&b"localhost"[..], b"127.0.0.1:10000", b"[::1]:80", b""] {
        assert!(!needs_replacing(good), "{good:?}");
    }
}

#[test]
fn a_path_authority_is_replaced_and_the_tables_stay_in_step() {
    let path = b"/run/example-csi/csi.sock";
    // First request: :method POST (3), :scheme http (6), :path literal,
    // :authority indexed into the table, a custom header indexed too.
    let mut block1 = vec![0x83, 0x86];
    block1.extend(lit_indexed(4, b"/csi.v1.Identity/Probe"));
    block1.extend(lit_indexed(1, path));
    block1.extend([0x40]);
    put_string(&mut block1, b"x-mine");
    put_string(&mut block1, b"value");
    // The second request refers to the three table entries: x-mine is
    // index 62 (0xBE), :authority 63 (0xBF), :path 64 (0xC0).
    let block2 = vec![0x83, 0x86, 0xC0, 0xBF, 0xBE];
    let mut input = PREFACE.to_vec();
    input.extend(headers_frame(FLAG_END_HEADERS, 1, &block1));
    input.extend(headers_frame(
        FLAG_END_HEADERS | FLAG_END_STREAM,
        3,
        &block2,
    ));
    let out = run(&input);
    let f = frames(&out);
    assert_eq!(f.len(), 2);
    let requests = served(&out, 2);
    assert_eq!(requests.len(), 2, "h2 accepts both requests");
    for (authority, path, fields) in &requests {
        assert_eq!(authority, "_run_example-csi_csi.sock");
        assert_eq!(path, "/csi.v1.Identity/Probe");
        assert!(
            fields.contains(&("x-mine".into(), "value".into())),
            "{fields:?}"
        );
    }
    // The second block needed no change and is passed as it came.
    assert_eq!(f[1].2, block2);
    assert_eq!(f[1].1, FLAG_END_HEADERS | FLAG_END_STREAM);
}

#[test]
fn huffman_coded_values_and_padding_are_handled() {
    // "www.example.com" Huffman-coded (RFC 7541, C.4.1) is a valid authority:
    // nothing changes, padding included.
    let www = [
        0x8c, 0xf1, 0xe3, 0xc2, 0xe5, 0xf2, 0x3a, 0x6b, 0xa0, 0xab, 0x90, 0xf4, 0xff,
    ];
    let mut block = vec![0x82, 0x86, 0x84, 0x41];
    block.extend(www);
    let mut payload = vec![3u8]; // pad length
    payload.extend(&block);
    payload.extend([0, 0, 0]);
    let mut input = PREFACE.to_vec();
    input.extend(headers_frame(FLAG_END_HEADERS | FLAG_PADDED, 1, &payload));
    assert_eq!(run(&input), input);

    // "/a" Huffman-coded ('/' is 011000, 'a' 00011, then EOS padding) is
    // not: it becomes a raw "_a", and the padding is dropped.
    let mut block = vec![0x82, 0x86, 0x84, 0x41, 0x82, 0x60, 0x7F];
    let mut payload = vec![2u8];
    payload.append(&mut block);
    payload.extend([0, 0]);
    let mut input = PREFACE.to_vec();
    input.extend(headers_frame(FLAG_END_HEADERS | FLAG_PADDED, 1, &payload));
    let f = frames(&run(&input));
    assert_eq!(f[0].1, FLAG_END_HEADERS);
    assert_eq!(f[0].2, [0x82, 0x86, 0x84, 0x41, 0x02, b'_', b'a']);
}

#[test]
fn a_block_split_over_continuations_is_rewritten_into_valid_frames() {
    let path = b"/var/lib/kubelet/plugins/example.csi.k8s.io/csi.sock";
    let mut block = vec![0x83, 0x86, 0x84];
    // Never indexed, literal name.
    block.push(0x10);
    put_string(&mut block, b":authority");
    put_string(&mut block, path);
    block.extend(lit_indexed(58, &vec![b'u'; 20_000]));
    let (a, b) = block.split_at(10);
    let mut input = PREFACE.to_vec();
    let mut prio = vec![0x80, 0, 0, 1, 15];
    prio.extend(a);
    input.extend(headers_frame(FLAG_PRIORITY | FLAG_END_STREAM, 5, &prio));
    for (i, chunk) in b.chunks(MAX_FRAME).enumerate() {
        let last = (i + 1) * MAX_FRAME >= b.len();
        frame_header(
            &mut input,
            chunk.len(),
            TYPE_CONTINUATION,
            if last { FLAG_END_HEADERS } else { 0 },
            5u32.to_be_bytes(),
        );
        input.extend(chunk);
    }
    let out = run(&input);
    let f = frames(&out);
    assert!(f.len() >= 2);
    assert_eq!(f[0].0, TYPE_HEADERS);
    assert_eq!(f[0].1 & FLAG_END_STREAM, FLAG_END_STREAM);
    assert_eq!(f[0].1 & FLAG_PRIORITY, FLAG_PRIORITY);
    assert!(f.iter().all(|x| x.2.len() <= MAX_FRAME));
    assert_eq!(f.last().unwrap().1 & FLAG_END_HEADERS, FLAG_END_HEADERS);
    assert!(f[1..].iter().all(|x| x.0 == TYPE_CONTINUATION));
    let requests = served(&out, 1);
    assert_eq!(requests.len(), 1, "h2 accepts the request");
    let (authority, _, fields) = &requests[0];
    assert_eq!(authority.len(), path.len());
    assert_eq!(fields.last().unwrap().1.len(), 20_000);
}

#[test]
fn other_frames_and_garbage_pass_unchanged() {
    let mut input = PREFACE.to_vec();
    // SETTINGS (empty), DATA with a payload, PING.
    frame_header(&mut input, 0, 0x4, 0, [0; 4]);
    frame_header(&mut input, 5, 0x0, 1, 1u32.to_be_bytes());
    input.extend(b"hello");
    frame_header(&mut input, 8, 0x6, 0, [0; 4]);
    input.extend([1; 8]);
    assert_eq!(run(&input), input);
    // Not HTTP/2 at all.
    assert_eq!(run(b"GET / HTTP/1.1\r\n\r\n"), b"GET / HTTP/1.1\r\n\r\n");
    // A malformed block: passed on as it came, then passthrough.
    let mut bad = PREFACE.to_vec();
    bad.extend(headers_frame(FLAG_END_HEADERS, 1, &[0x80]));
    bad.extend(headers_frame(FLAG_END_HEADERS, 3, &lit_indexed(1, b"/x")));
    assert_eq!(run(&bad), bad);
    // A truncated connection: held bytes go on at the end.
    let mut cut = PREFACE.to_vec();
    cut.extend(&headers_frame(0, 1, &lit_indexed(1, b"/x"))[..12]);
    assert_eq!(run(&cut), cut);
}

#[test]
fn table_eviction_follows_the_decoded_sizes() {
    let mut t = Table::new();
    t.resize(100);
    t.insert(10, 20, true); // 62
    t.insert(5, 5, false); // 42: 62 + 42 > 100, the first is evicted
    assert_eq!(t.entries.len(), 1);
    assert_eq!(t.name(62), Ok((5, false)));
    assert_eq!(t.name(63), Err(Malformed));
    t.insert(100, 0, false);
    assert!(t.entries.is_empty());
}
