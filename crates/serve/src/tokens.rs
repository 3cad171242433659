//! Tokens: the admin's and each sandbox's bearer token, drawn at random and kept only as
//! their SHA-256, and the credential key drawn the same way.
//!
//! A token is compared by its hash, in constant time, so neither the files on disk nor the
//! time a check takes give one away.

use sha2::{Digest, Sha256};

use crate::error::ServeError;

/// Constant-time comparison of two hashes.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

pub fn hash_token(token: &str) -> String {
    let digest = Sha256::digest(token.as_bytes());
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `token` hashes to `hash` (compared in constant time).
pub fn token_matches(hash: &str, token: &str) -> bool {
    same(hash.as_bytes(), hash_token(token).as_bytes())
}

/// Whether `token` is spelled as this manager writes its tokens: `prefix` then 64 lower-case
/// hex digits, nothing else (no case variant, sign, whitespace or padding). A token is
/// accepted in this one spelling only.
pub fn canonical(prefix: &str, token: &str) -> bool {
    token.strip_prefix(prefix).is_some_and(|hex| {
        hex.len() == 64
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

/// A new token: 32 random bytes, hex, with a prefix that says what it is.
pub fn new_token(prefix: &str) -> Result<String, ServeError> {
    let mut bytes = [0u8; 32];
    let mut filled = 0;
    while filled < bytes.len() {
        // SAFETY: getrandom writes at most the given length into the buffer, which lives
        // across the call.
        let n = unsafe {
            libc::getrandom(bytes[filled..].as_mut_ptr().cast(), bytes.len() - filled, 0)
        };
        match usize::try_from(n) {
            Ok(n) => filled += n,
            Err(_) => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(ServeError::Io {
                        what: "draw a random token from",
                        path: "getrandom".into(),
                        source: e,
                    });
                }
            }
        }
    }
    Ok(format!(
        "{prefix}{}",
        bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_random_and_checked_by_hash() {
        let a = new_token("mfs_").unwrap();
        let b = new_token("mfs_").unwrap();
        assert_ne!(a, b);
        assert_eq!(a.len(), 4 + 64);
        assert!(same(hash_token(&a).as_bytes(), hash_token(&a).as_bytes()));
        assert!(!same(hash_token(&a).as_bytes(), hash_token(&b).as_bytes()));
        assert!(canonical("mfs_", &a));
        let upper = format!("mfs_{}", a[4..].to_uppercase());
        for bad in [
            &upper,
            &format!("{a} "),
            &format!(" {a}"),
            &format!("{a}="),
            &a[..67],
        ] {
            assert!(!canonical("mfs_", bad), "{bad}");
        }
        assert!(!canonical("mfs_", &format!("mfs_+{}", &a[5..])));
    }
}
