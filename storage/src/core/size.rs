//! Sizes as people write them (`1Gi`, `500M`, `4096`): the one parser for the
//! client's flags, the benchmark's and an ephemeral volume's `size` attribute.

/// What a unit multiplies by: binary (Ki..Ti) and decimal (k/K..T), as
/// Kubernetes quantities spell them.
fn multiplier(unit: &str) -> Option<i64> {
    Some(match unit {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "k" | "K" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        _ => return None,
    })
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    #[error("{0:?} is not a size: expected a whole number of bytes with an optional unit (Ki, Mi, Gi, Ti, k, M, G, T)")]
    Malformed(String),
    #[error("{0:?} is not a size: a size cannot be negative")]
    Negative(String),
    #[error("{input:?} is not a size: unknown unit {unit:?} (Ki, Mi, Gi, Ti, k, M, G, T)")]
    UnknownUnit { input: String, unit: String },
    /// CSI carries sizes as int64.
    #[error("{0:?} is too large: a size is at most {max} bytes", max = i64::MAX)]
    TooLarge(String),
}

/// Parses a whole number of bytes with an optional unit, surrounding spaces
/// ignored. The result is never negative.
pub fn parse_size(s: &str) -> Result<i64, SizeError> {
    let s = s.trim();
    if s.starts_with('-') {
        return Err(SizeError::Negative(s.to_string()));
    }
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, unit) = s.split_at(split);
    if digits.is_empty() || unit.starts_with(['.', ',']) {
        return Err(SizeError::Malformed(s.to_string()));
    }
    let Some(mult) = multiplier(unit) else {
        return Err(SizeError::UnknownUnit {
            input: s.to_string(),
            unit: unit.to_string(),
        });
    };
    digits
        .parse::<i64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| SizeError::TooLarge(s.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_bytes_and_every_unit() {
        let cases = [
            ("0", 0),
            ("4096", 4096),
            ("1Ki", 1024),
            ("100Mi", 100 << 20),
            ("1Gi", 1 << 30),
            ("2Ti", 2 << 40),
            ("1k", 1000),
            ("1K", 1000),
            ("500M", 500_000_000),
            ("2G", 2_000_000_000),
            ("3T", 3_000_000_000_000),
            (" 64Mi\n", 64 << 20),
            ("007", 7),
        ];
        for (s, want) in cases {
            assert_eq!(parse_size(s), Ok(want), "{s:?}");
        }
    }

    #[test]
    fn the_largest_size_is_the_largest_int64() {
        assert_eq!(parse_size("9223372036854775807"), Ok(i64::MAX));
        assert_eq!(parse_size("8388607Ti"), Ok(8_388_607 << 40));
        for s in [
            "9223372036854775808",
            "18446744073709551615",
            "99999999999999999999999",
            "8388608Ti",
            "99999999999Ti",
        ] {
            assert_eq!(parse_size(s), Err(SizeError::TooLarge(s.into())), "{s}");
        }
    }

    #[test]
    fn garbage_is_refused_with_the_reason() {
        for s in ["", " ", "Gi", "abc", "1.5Gi", "1,5G", "+5", "0x10", "1 Gi"] {
            let e = parse_size(s).unwrap_err();
            assert!(
                matches!(e, SizeError::Malformed(_) | SizeError::UnknownUnit { .. }),
                "{s:?}: {e}"
            );
            assert!(e.to_string().contains("is not a size"), "{e}");
        }
        for s in ["1Xi", "1gi", "1e30", "16Ei", "8191Pi", "1KiB"] {
            let e = parse_size(s);
            assert!(
                matches!(e, Err(SizeError::UnknownUnit { .. })),
                "{s}: {e:?}"
            );
        }
        assert_eq!(
            parse_size("1.5Gi").unwrap_err().to_string(),
            "\"1.5Gi\" is not a size: expected a whole number of bytes with an optional \
             unit (Ki, Mi, Gi, Ti, k, M, G, T)"
        );
    }

    #[test]
    fn negative_sizes_are_refused_as_such() {
        for s in ["-1", "-1Gi", " -0"] {
            let e = parse_size(s).unwrap_err();
            assert_eq!(e, SizeError::Negative(s.trim().into()));
            assert!(e.to_string().contains("cannot be negative"), "{e}");
        }
    }
}
