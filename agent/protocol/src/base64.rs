//! Standard base64 (RFC 4648, `+/` alphabet, `=` padding), for the refresh op's entropy.
//! Small enough to keep here rather than add a dependency to both the agent and the VMM.

const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Encodes with padding.
pub fn encode(data: &[u8]) -> String {
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

fn value(c: u8) -> Option<u32> {
    Some(match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        _ => return None,
    } as u32)
}

/// Decodes padded or unpadded input; anything else (whitespace, other alphabets, bad
/// padding, non-zero trailing bits) is an error that names the problem.
pub fn decode(text: &str) -> Result<Vec<u8>, String> {
    let bytes = text.as_bytes();
    let trimmed = match bytes {
        [rest @ .., b'=', b'='] => rest,
        [rest @ .., b'='] => rest,
        _ => bytes,
    };
    let padded = bytes.len() != trimmed.len();
    let partial_group = bytes.len() % 4;
    if padded && partial_group != 0 {
        return Err("base64 padding does not end a 4-character group".into());
    }
    if trimmed.len() % 4 == 1 {
        return Err("base64 length is impossible (one character too many or too few)".into());
    }
    let mut out = Vec::with_capacity(trimmed.len() * 3 / 4);
    for group in trimmed.chunks(4) {
        let mut n = 0u32;
        for (i, &c) in group.iter().enumerate() {
            let v = value(c).ok_or_else(|| format!("{:?} is not a base64 character", c as char))?;
            n |= v << (18 - 6 * i);
        }
        let produced = group.len() - 1;
        let full = n.to_be_bytes();
        out.extend_from_slice(&full[1..1 + produced]);
        // The bits below the last produced byte must be zero in canonical encoding.
        if produced < 3 && (n << (8 * (produced + 1))) != 0 {
            return Err("base64 has non-zero padding bits".into());
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc4648_vectors() {
        let cases = [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ];
        for (plain, enc) in cases {
            assert_eq!(encode(plain.as_bytes()), enc);
            assert_eq!(decode(enc).unwrap(), plain.as_bytes());
            assert_eq!(decode(enc.trim_end_matches('=')).unwrap(), plain.as_bytes());
        }
    }

    #[test]
    fn all_bytes_round_trip() {
        let data: Vec<u8> = (0..=255u8).cycle().take(1000).collect();
        assert_eq!(decode(&encode(&data)).unwrap(), data);
    }

    #[test]
    fn rejects_garbage() {
        for bad in ["Zg=", "Z", "Zm9v!", "Zm 9v", "Zh==", "Zm9=v", "===="] {
            assert!(decode(bad).is_err(), "{bad:?} decoded");
        }
    }
}
