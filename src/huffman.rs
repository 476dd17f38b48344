//! The Huffman code of HPACK (RFC 7541, appendix B), decoding only: `:authority`
//! values may come Huffman-coded, and the reader that mends them must see their
//! bytes.
//!
//! The code is canonical (within each length, codes rise with the symbol), so
//! the lengths alone define it; they are the table below, symbols grouped by
//! their code's length. Symbol 256 is EOS.

/// (code length in bits, the symbols whose code has that length, ascending).
const LENGTHS: [(usize, &[u16]); 21] = [
    (5, &[48, 49, 50, 97, 99, 101, 105, 111, 115, 116]),
    (
        6,
        &[
            32, 37, 45, 46, 47, 51, 52, 53, 54, 55, 56, 57, 61, 65, 95, 98, 100, 102, 103, 104,
            108, 109, 110, 112, 114, 117,
        ],
    ),
    (
        7,
        &[
            58, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81, 82, 83, 84, 85, 86,
            87, 89, 106, 107, 113, 118, 119, 120, 121, 122,
        ],
    ),
    (8, &[38, 42, 44, 59, 88, 90]),
    (10, &[33, 34, 40, 41, 63]),
    (11, &[39, 43, 124]),
    (12, &[35, 62]),
    (13, &[0, 36, 64, 91, 93, 126]),
    (14, &[94, 125]),
    (15, &[60, 96, 123]),
    (19, &[92, 195, 208]),
    (20, &[128, 130, 131, 162, 184, 194, 224, 226]),
    (
        21,
        &[
            153, 161, 167, 172, 176, 177, 179, 209, 216, 217, 227, 229, 230,
        ],
    ),
    (
        22,
        &[
            129, 132, 133, 134, 136, 146, 154, 156, 160, 163, 164, 169, 170, 173, 178, 181, 185,
            186, 187, 189, 190, 196, 198, 228, 232, 233,
        ],
    ),
    (
        23,
        &[
            1, 135, 137, 138, 139, 140, 141, 143, 147, 149, 150, 151, 152, 155, 157, 158, 165, 166,
            168, 174, 175, 180, 182, 183, 188, 191, 197, 231, 239,
        ],
    ),
    (
        24,
        &[9, 142, 144, 145, 148, 159, 171, 206, 215, 225, 236, 237],
    ),
    (25, &[199, 207, 234, 235]),
    (
        26,
        &[
            192, 193, 200, 201, 202, 205, 210, 213, 218, 219, 238, 240, 242, 243, 255,
        ],
    ),
    (
        27,
        &[
            203, 204, 211, 212, 214, 221, 222, 223, 241, 244, 245, 246, 247, 248, 250, 251, 252,
            253, 254,
        ],
    ),
    (
        28,
        &[
            2, 3, 4, 5, 6, 7, 8, 11, 12, 14, 15, 16, 17, 18, 19, 20, 21, 23, 24, 25, 26, 27, 28,
            29, 30, 31, 127, 220, 249,
        ],
    ),
    (30, &[10, 13, 22, 256]),
];

const EOS: u16 = 256;
const LONGEST: usize = 30;

/// The canonical code laid out for decoding: per length, how many codes, the
/// first code, and where its symbols start in `symbols`.
struct Code {
    count: [u32; LONGEST + 1],
    first: [u32; LONGEST + 1],
    start: [usize; LONGEST + 1],
    symbols: [u16; 257],
}

const fn code() -> Code {
    let mut c = Code {
        count: [0; LONGEST + 1],
        first: [0; LONGEST + 1],
        start: [0; LONGEST + 1],
        symbols: [0; 257],
    };
    let mut n = 0;
    let mut g = 0;
    while g < LENGTHS.len() {
        let (len, syms) = LENGTHS[g];
        c.count[len] = syms.len() as u32;
        c.start[len] = n;
        let mut i = 0;
        while i < syms.len() {
            c.symbols[n] = syms[i];
            n += 1;
            i += 1;
        }
        g += 1;
    }
    let mut next = 0u32;
    let mut len = 1;
    while len <= LONGEST {
        c.first[len] = next;
        next = (next + c.count[len]) << 1;
        len += 1;
    }
    c
}

static CODE: Code = code();

/// Why a Huffman-coded string could not be decoded.
#[derive(Debug, PartialEq, Eq)]
pub struct Invalid;

/// Decodes a Huffman-coded HPACK string. Refuses what the RFC calls a decoding
/// error: an EOS symbol inside, padding longer than 7 bits, or padding that is
/// not the leading bits of EOS (all ones).
pub fn decode(coded: &[u8]) -> Result<Vec<u8>, Invalid> {
    let mut out = Vec::with_capacity(coded.len() * 8 / 5);
    let (mut value, mut len) = (0u32, 0usize);
    for byte in coded {
        for shift in (0..8).rev() {
            value = value << 1 | u32::from(byte >> shift & 1);
            len += 1;
            let offset = value.wrapping_sub(CODE.first[len]);
            if offset < CODE.count[len] {
                let symbol = CODE.symbols[CODE.start[len] + offset as usize];
                if symbol == EOS {
                    return Err(Invalid);
                }
                out.push(symbol as u8);
                (value, len) = (0, 0);
            } else if len == LONGEST {
                return Err(Invalid);
            }
        }
    }
    if len > 7 || value != (1 << len) - 1 {
        return Err(Invalid);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lengths_make_a_complete_prefix_code_of_every_symbol() {
        let mut seen = [false; 257];
        for (len, syms) in LENGTHS {
            assert!((5..=LONGEST).contains(&len));
            for &s in syms {
                assert!(!seen[s as usize], "symbol {s} twice");
                seen[s as usize] = true;
            }
        }
        assert!(seen.iter().all(|s| *s), "every symbol has a code");
        // Kraft's sum is exactly one: no code is a prefix of another, and no
        // bit string is left without a meaning.
        let kraft: u64 = LENGTHS
            .iter()
            .map(|(len, syms)| (syms.len() as u64) << (LONGEST - len))
            .sum();
        assert_eq!(kraft, 1 << LONGEST);
        // EOS is thirty ones, the last code of all.
        assert_eq!(CODE.first[30] + CODE.count[30] - 1, (1 << 30) - 1);
        assert_eq!(CODE.symbols[256], EOS);
    }

    #[test]
    fn decodes_the_examples_of_the_rfc() {
        // RFC 7541, C.4 and C.6: request and response fields, Huffman-coded.
        let cases: [(&str, &[u8]); 7] = [
            (
                "www.example.com",
                &[
                    0xf1, 0xe3, 0xc2, 0xe5, 0xf2, 0x3a, 0x6b, 0xa0, 0xab, 0x90, 0xf4, 0xff,
                ],
            ),
            ("no-cache", &[0xa8, 0xeb, 0x10, 0x64, 0x9c, 0xbf]),
            (
                "custom-key",
                &[0x25, 0xa8, 0x49, 0xe9, 0x5b, 0xa9, 0x7d, 0x7f],
            ),
            (
                "custom-value",
                &[0x25, 0xa8, 0x49, 0xe9, 0x5b, 0xb8, 0xe8, 0xb4, 0xbf],
            ),
            ("302", &[0x64, 0x02]),
            ("private", &[0xae, 0xc3, 0x77, 0x1a, 0x4b]),
            (
                "Mon, 21 Oct 2013 20:13:21 GMT",
                &[
                    0xd0, 0x7a, 0xbe, 0x94, 0x10, 0x54, 0xd4, 0x44, 0xa8, 0x20, 0x05, 0x95, 0x04,
                    0x0b, 0x81, 0x66, 0xe0, 0x82, 0xa6, 0x2d, 0x1b, 0xff,
                ],
            ),
        ];
        for (text, coded) in cases {
            assert_eq!(decode(coded).as_deref(), Ok(text.as_bytes()), "{text}");
        }
        let cookie = [
            0x94, 0xe7, 0x82, 0x1d, 0xd7, 0xf2, 0xe6, 0xc7, 0xb3, 0x35, 0xdf, 0xdf, 0xcd, 0x5b,
            0x39, 0x60, 0xd5, 0xaf, 0x27, 0x08, 0x7f, 0x36, 0x72, 0xc1, 0xab, 0x27, 0x0f, 0xb5,
            0x29, 0x1f, 0x95, 0x87, 0x31, 0x60, 0x65, 0xc0, 0x03, 0xed, 0x4e, 0xe5, 0xb1, 0x06,
            0x3d, 0x50, 0x07,
        ];
        assert_eq!(
            decode(&cookie).unwrap(),
            b"foo=ASDJKHQKBZXOQWEOPIUAXQWEOIU; max-age=3600; version=1"
        );
        assert_eq!(decode(&[]), Ok(Vec::new()));
    }

    #[test]
    fn refuses_what_the_rfc_calls_decoding_errors() {
        // Padding of eight ones, padding that is not ones, and EOS coded in full.
        assert_eq!(decode(&[0xff]), Err(Invalid));
        assert_eq!(decode(&[0x00]), Err(Invalid), "'0' then 000 padding");
        assert_eq!(decode(&[0xff, 0xff, 0xff, 0xfc]), Err(Invalid));
        assert_eq!(decode(&[0xff, 0xff, 0xff, 0xff]), Err(Invalid));
        // '0' (00000) with 111 padding is fine.
        assert_eq!(decode(&[0x07]), Ok(b"0".to_vec()));
    }
}
