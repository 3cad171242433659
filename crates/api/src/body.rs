//! The bodies of the control socket's requests, as types: the server reads each request's body
//! into its type (serde, then the checks no type can say), and clients (`mayfly`'s own
//! commands, the manager) write them from the same types.

use std::fmt;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize};

use crate::action::MAX_FORK_COUNT;

/// `PUT /vm/snapshot`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotBody {
    /// The directory to write the snapshot to (required: a non-empty path).
    #[serde(default)]
    pub path: Option<String>,
    /// Only the pages written since the restore, over the snapshot restored from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub diff: Option<bool>,
}

impl SnapshotBody {
    pub const FIELDS: &'static [&'static str] = &["path", "diff"];
    pub const EXAMPLE: &'static str = r#"{"path": "/some/dir"}"#;
}

/// What the parent VM does after a fork.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ForkParent {
    #[default]
    Running,
    Paused,
}

/// `PUT /vm/fork`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ForkBody {
    /// How many clones (required; at most [`MAX_FORK_COUNT`]).
    #[serde(default)]
    pub count: Option<Count>,
    /// Clones are named `<prefix><n>`; default `<parent's name>-`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name_prefix: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<ForkParent>,
    /// Count only what starting the clones costs the host, not the guest memory they write.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overcommit: Option<bool>,
}

impl ForkBody {
    pub const FIELDS: &'static [&'static str] = &["count", "name_prefix", "parent", "overcommit"];
    pub const EXAMPLE: &'static str = r#"{"count": 2, "name_prefix": "web", "parent": "paused"}"#;
}

/// A fork's clone count: an integer from 0 to [`MAX_FORK_COUNT`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Count(pub u32);

impl<'de> Deserialize<'de> for Count {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct CountVisitor;
        impl Visitor<'_> for CountVisitor {
            type Value = Count;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                write!(
                    f,
                    "an integer from 0 to {MAX_FORK_COUNT} (the most clones mayfly allows in \
                     one fork)"
                )
            }
            fn visit_u64<E: de::Error>(self, n: u64) -> Result<Count, E> {
                u32::try_from(n)
                    .ok()
                    .filter(|&n| n <= MAX_FORK_COUNT)
                    .map(Count)
                    .ok_or_else(|| E::invalid_value(de::Unexpected::Unsigned(n), &self))
            }
            fn visit_i64<E: de::Error>(self, n: i64) -> Result<Count, E> {
                u64::try_from(n)
                    .map_err(|_| E::invalid_value(de::Unexpected::Signed(n), &self))
                    .and_then(|n| self.visit_u64(n))
            }
        }
        deserializer.deserialize_u64(CountVisitor)
    }
}

/// `PUT /vm/net/policy`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetPolicyBody {
    /// `none`, `open` or `allow=CIDR[:PORT],...` (required).
    #[serde(default)]
    pub policy: Option<String>,
}

impl NetPolicyBody {
    pub const FIELDS: &'static [&'static str] = &["policy"];
    pub const EXAMPLE: &'static str = r#"{"policy": "allow=192.0.2.0/24:443,198.51.100.7"}"#;
}

/// `PUT /vm/net/expose`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExposeBody {
    /// The guest's port (required).
    #[serde(default)]
    pub port: Option<Port>,
    /// Where to listen on the host: `tcp:ADDR:PORT` (port 0: a free one) or `unix:PATH`;
    /// default `tcp:127.0.0.1:0`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on: Option<String>,
}

impl ExposeBody {
    pub const FIELDS: &'static [&'static str] = &["port", "on"];
    pub const EXAMPLE: &'static str = r#"{"port": 8080, "on": "tcp:127.0.0.1:0"}"#;
}

/// `PUT /vm/net/unexpose`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UnexposeBody {
    /// The guest's port (required).
    #[serde(default)]
    pub port: Option<Port>,
    /// Only the endpoint at this address (`tcp:ADDR:PORT` or `unix:PATH`, as `host` answered
    /// it); every endpoint of the port without it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on: Option<String>,
}

impl UnexposeBody {
    pub const FIELDS: &'static [&'static str] = &["port", "on"];
    pub const EXAMPLE: &'static str = r#"{"port": 8080}"#;
}

/// A TCP port from 1 to 65535.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Port(pub u16);

impl<'de> Deserialize<'de> for Port {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct PortVisitor;
        impl Visitor<'_> for PortVisitor {
            type Value = Port;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a port from 1 to 65535")
            }
            fn visit_u64<E: de::Error>(self, n: u64) -> Result<Port, E> {
                u16::try_from(n)
                    .ok()
                    .filter(|&n| n != 0)
                    .map(Port)
                    .ok_or_else(|| E::invalid_value(de::Unexpected::Unsigned(n), &self))
            }
            fn visit_i64<E: de::Error>(self, n: i64) -> Result<Port, E> {
                u64::try_from(n)
                    .map_err(|_| E::invalid_value(de::Unexpected::Signed(n), &self))
                    .and_then(|n| self.visit_u64(n))
            }
        }
        deserializer.deserialize_u64(PortVisitor)
    }
}

/// A request that takes no body (or `{}`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoBody {}

impl NoBody {
    pub const FIELDS: &'static [&'static str] = &[];
    pub const EXAMPLE: &'static str = "{}";
}

/// Whole numbers written with a fraction or an exponent (`3092.0`, `1e3`) as the integers
/// they are, everywhere in `value`: JSON Schema (and so the OpenAPI documents) counts them as
/// integers, and an integer field should take them; serde's integer types would not.
/// Numbers with a fraction, and whole ones past what an `i64` or `u64` holds, stay as they are
/// (and are refused by an integer field as before).
pub fn whole_numbers_as_integers(value: &mut serde_json::Value) {
    use serde_json::Value;
    match value {
        Value::Number(n) if !n.is_i64() && !n.is_u64() => {
            let Some(f) = n.as_f64() else { return };
            // Within ±2^63 (and up to 2^64 for positive ones) an f64 that is whole converts
            // exactly; anything past that is left to be refused.
            // 2^64 and -2^63, exactly.
            const PAST_U64: f64 = 18_446_744_073_709_551_616.0;
            const I64_MIN: f64 = -9_223_372_036_854_775_808.0;
            let whole = if f.fract() != 0.0 || !f.is_finite() {
                None
            } else if (0.0..PAST_U64).contains(&f) {
                Some(Value::from(f as u64))
            } else if (I64_MIN..0.0).contains(&f) {
                Some(Value::from(f as i64))
            } else {
                None
            };
            if let Some(whole) = whole {
                *value = whole;
            }
        }
        Value::Array(items) => items.iter_mut().for_each(whole_numbers_as_integers),
        Value::Object(fields) => fields.values_mut().for_each(whole_numbers_as_integers),
        _ => {}
    }
}
