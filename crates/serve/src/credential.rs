//! Sandbox credentials: what a sandbox's guest holds to say which sandbox it is and whom it
//! acts for, and what the manager checks.
//!
//! At its create the manager gives each sandbox (its guest, through the agent) the file
//! [`GUEST_PATH`]: `{"sandbox": NAME, "acts_for": ..., "created_ms": ..., "id": ...,
//! "credential": "mfc_..."}` (and `audience`, `expires_ms` when it was minted with them). The
//! credential is the claims (the fields but `credential`) signed with HMAC-SHA256 under the
//! manager's own key (`<state-dir>/credential.key`, made at the first start, mode 0600):
//! `mfc_` + hex(claims JSON) + `.` + hex(MAC), the hex lower case (the one spelling that
//! verifies). Anything the guest talks to (a service of the platform's) can send it to
//! `POST /credentials/verify`, and the manager answers whether it is one it made for a
//! sandbox that still exists (the same name and create time: a sandbox deleted and made again
//! under its name is another sandbox), and the one of the sandbox's credentials that verifies
//! now: the sandbox's record keeps the `id` of the latest minted (`POST
//! /sandboxes/NAME/credential` mints a new one, with an audience and an expiry if asked;
//! `DELETE` revokes), and an expired one does not verify.
//!
//! It is not the sandbox's token (which reaches the manager's API for that sandbox and must
//! never be inside a guest the sandbox's user does not control): it grants nothing by
//! itself, only says who. A fork's clones get credentials of their own (their file replaced);
//! they also hold their source's in their memory, as they hold everything the source had, but
//! that one says it is the source, and stops verifying when the source's is rotated.

use std::path::Path;

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use crate::error::ServeError;
use crate::tokens::new_token;
use crate::util::write_atomically;

/// Where the guest finds its credential.
pub const GUEST_PATH: &str = "/run/mayfly/sandbox.json";
const PREFIX: &str = "mfc_";
/// Longest credential looked at (a claims object is a few hundred bytes).
const MAX_LEN: usize = 4096;

/// What a credential says.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Claims {
    /// Its subject: the sandbox it names.
    pub sandbox: String,
    pub acts_for: Option<String>,
    pub created_ms: u64,
    /// Which of the sandbox's credentials it is: only the latest minted verifies (a
    /// credential made before ids has none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Whom it is meant for (the service it is shown to), if it was minted for one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audience: Option<String>,
    /// When it stops verifying, ms since the epoch; none: while it is the sandbox's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_ms: Option<u64>,
}

/// The manager's signing key.
pub struct Keys {
    key: Vec<u8>,
}

impl Keys {
    /// The key in `dir/credential.key`, made if missing.
    pub fn open(dir: &Path) -> Result<Keys, ServeError> {
        let path = dir.join("credential.key");
        // Made only when there is none: any other failure to read it is an error, as a new
        // key would silently make every credential given out invalid.
        let key = match std::fs::read_to_string(&path) {
            Ok(key) if !key.trim().is_empty() => key.trim().to_owned(),
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(ServeError::Io {
                    what: "read",
                    path: path.display().to_string(),
                    source: e,
                })
            }
            Ok(_) | Err(_) => {
                let key = new_token("mfk_")?;
                write_atomically(&path, format!("{key}\n").as_bytes())?;
                key
            }
        };
        Ok(Keys {
            key: key.into_bytes(),
        })
    }

    fn mac(&self) -> Hmac<Sha256> {
        // HMAC takes a key of any length.
        Hmac::<Sha256>::new_from_slice(&self.key).expect("HMAC takes any key length")
    }

    /// A credential for `claims`.
    pub fn mint(&self, claims: &Claims) -> String {
        let body = serde_json::to_vec(claims).unwrap_or_default();
        let mut mac = self.mac();
        mac.update(&body);
        format!(
            "{PREFIX}{}.{}",
            hex(&body),
            hex(&mac.finalize().into_bytes())
        )
    }

    /// What `credential` says, if this manager made it (the MAC compared in constant time).
    pub fn check(&self, credential: &str) -> Result<Claims, String> {
        let bad = "not a credential of this manager's (mfc_... as in the guest's /run/mayfly/sandbox.json)";
        if credential.len() > MAX_LEN {
            return Err(bad.into());
        }
        let (body, tag) = credential
            .strip_prefix(PREFIX)
            .and_then(|rest| rest.split_once('.'))
            .ok_or(bad)?;
        let (body, tag) = (unhex(body).ok_or(bad)?, unhex(tag).ok_or(bad)?);
        let mut mac = self.mac();
        mac.update(&body);
        mac.verify_slice(&tag).map_err(|_| {
            "its signature is not this manager's: it was changed, or made by another manager"
                .to_string()
        })?;
        serde_json::from_slice(&body).map_err(|_| bad.into())
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Lower-case hex only, as [`hex`] writes it: one spelling of each credential verifies (no
/// upper case, no sign, no whitespace).
fn unhex(text: &str) -> Option<Vec<u8>> {
    fn digit(b: u8) -> Option<u8> {
        match b {
            b'0'..=b'9' => Some(b - b'0'),
            b'a'..=b'f' => Some(b - b'a' + 10),
            _ => None,
        }
    }
    let bytes = text.as_bytes();
    if !bytes.len().is_multiple_of(2) {
        return None;
    }
    bytes
        .chunks(2)
        .map(|pair| Some(digit(pair[0])? << 4 | digit(pair[1])?))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_say_what_they_were_made_for_and_nothing_else_passes() {
        let dir = std::env::temp_dir().join(format!("mayfly-cred-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let keys = Keys::open(&dir).unwrap();
        let claims = Claims {
            sandbox: "box".into(),
            acts_for: Some("user:alice".into()),
            created_ms: 42,
            id: Some("mci_1".into()),
            audience: Some("svc".into()),
            expires_ms: Some(7),
        };
        let credential = keys.mint(&claims);
        assert_eq!(keys.check(&credential), Ok(claims.clone()));
        // The same key from the file: credentials outlive a manager's restart.
        assert_eq!(Keys::open(&dir).unwrap().check(&credential), Ok(claims));
        // Another manager's key, a changed claim, a cut or odd one: refused.
        let other = std::env::temp_dir().join(format!("mayfly-cred2-{}", std::process::id()));
        std::fs::create_dir_all(&other).unwrap();
        assert!(Keys::open(&other).unwrap().check(&credential).is_err());
        let (body, tag) = credential.split_once('.').unwrap();
        let forged = body.replacen(&hex(b"box"), &hex(b"bot"), 1);
        assert!(keys.check(&format!("{forged}.{tag}")).is_err());
        for bad in [
            "",
            "mfc_",
            "mfc_zz.00",
            "mfc_00",
            &credential[..credential.len() - 1],
            &credential.to_uppercase(),
            &format!("mfc_{}", credential[4..].to_uppercase()),
            &format!("{credential} "),
            &credential.replacen("mfc_7b", "mfc_+b", 1),
        ] {
            assert!(keys.check(bad).is_err(), "{bad}");
        }
        assert!(keys.check(&"a".repeat(MAX_LEN + 1)).is_err());
        let _ = std::fs::remove_dir_all(&dir);
        let _ = std::fs::remove_dir_all(&other);
    }
}
