//! Typed payloads. Requests (host to agent) refuse unknown fields, so a typo in a field
//! name is an error rather than a silently ignored option. Replies (agent to host) accept
//! unknown fields, so a host keeps working with a newer agent that adds optional fields.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, DeserializeOwned, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{FrameError, ProtocolError};
pub use crate::error_code::ErrorCode;
use crate::frame::{encode_frame, Frame};
use crate::frame_type::FrameType;

/// Every op a version-1 agent implements, in the order PROTOCOL.md lists them.
pub const OPS: &[&str] = &[
    "exec",
    "write_file",
    "read_file",
    "stat",
    "list",
    "remove",
    "mkdir",
    "refresh",
    "identity",
    "ping",
];

/// The PATH an exec'd program gets unless the request replaces it.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// One decoded frame.
#[derive(Debug, Clone, PartialEq)]
pub enum Message {
    Hello(Hello),
    Request(Request),
    /// Bytes for the program's stdin; empty means end of input.
    Stdin(Vec<u8>),
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    Exit(ExitRecord),
    Signal(SignalRequest),
    /// The op-specific success reply; see the `*Reply` types.
    Ok(serde_json::Value),
    Error(ErrorReply),
    /// File contents; empty means end of data.
    Data(Vec<u8>),
    Started(Started),
    Entries(Vec<DirEntry>),
}

impl Message {
    pub fn frame_type(&self) -> FrameType {
        match self {
            Message::Hello(_) => FrameType::Hello,
            Message::Request(_) => FrameType::Request,
            Message::Stdin(_) => FrameType::Stdin,
            Message::Stdout(_) => FrameType::Stdout,
            Message::Stderr(_) => FrameType::Stderr,
            Message::Exit(_) => FrameType::Exit,
            Message::Signal(_) => FrameType::Signal,
            Message::Ok(_) => FrameType::Ok,
            Message::Error(_) => FrameType::Error,
            Message::Data(_) => FrameType::Data,
            Message::Started(_) => FrameType::Started,
            Message::Entries(_) => FrameType::Entries,
        }
    }

    /// An OK message carrying `reply`.
    pub fn ok<T: Serialize>(reply: &T) -> Result<Message, ProtocolError> {
        serde_json::to_value(reply)
            .map(Message::Ok)
            .map_err(|e| ProtocolError::Other(format!("cannot encode an OK reply: {e}")))
    }

    /// An ERROR message.
    pub fn error(code: ErrorCode, message: impl Into<String>) -> Message {
        Message::Error(ErrorReply {
            error: message.into(),
            code,
        })
    }

    /// The complete frame (length prefix included).
    pub fn encode(&self) -> Result<Vec<u8>, ProtocolError> {
        let kind = self.frame_type();
        let json = |value: Result<Vec<u8>, serde_json::Error>| {
            value.map_err(|e| ProtocolError::Other(format!("cannot encode a {kind} frame: {e}")))
        };
        let payload: Vec<u8>;
        let bytes: &[u8] = match self {
            Message::Stdin(b) | Message::Stdout(b) | Message::Stderr(b) | Message::Data(b) => b,
            Message::Hello(v) => {
                payload = json(serde_json::to_vec(v))?;
                &payload
            }
            Message::Request(v) => {
                payload = json(serde_json::to_vec(v))?;
                &payload
            }
            Message::Exit(v) => {
                payload = json(serde_json::to_vec(v))?;
                &payload
            }
            Message::Signal(v) => {
                payload = json(serde_json::to_vec(v))?;
                &payload
            }
            Message::Ok(v) => {
                payload = json(serde_json::to_vec(v))?;
                &payload
            }
            Message::Error(v) => {
                payload = json(serde_json::to_vec(v))?;
                &payload
            }
            Message::Started(v) => {
                payload = json(serde_json::to_vec(v))?;
                &payload
            }
            Message::Entries(v) => {
                payload = json(serde_json::to_vec(v))?;
                &payload
            }
        };
        encode_frame(kind, bytes)
    }

    /// Decodes a frame's payload according to its type.
    pub fn from_frame(frame: Frame) -> Result<Message, ProtocolError> {
        let kind = frame.kind;
        let p = frame.payload;
        Ok(match kind {
            FrameType::Stdin => Message::Stdin(p),
            FrameType::Stdout => Message::Stdout(p),
            FrameType::Stderr => Message::Stderr(p),
            FrameType::Data => Message::Data(p),
            FrameType::Hello => Message::Hello(parse_json(kind, &p)?),
            FrameType::Request => {
                Message::Request(Request::parse(&p).map_err(|e| ProtocolError::BadPayload {
                    frame: kind,
                    reason: e.to_string(),
                })?)
            }
            FrameType::Exit => Message::Exit(parse_json(kind, &p)?),
            FrameType::Signal => Message::Signal(parse_json(kind, &p)?),
            FrameType::Ok => Message::Ok(parse_json(kind, &p)?),
            FrameType::Error => Message::Error(parse_json(kind, &p)?),
            FrameType::Started => Message::Started(parse_json(kind, &p)?),
            FrameType::Entries => Message::Entries(parse_json(kind, &p)?),
        })
    }
}

fn parse_json<T: DeserializeOwned>(frame: FrameType, payload: &[u8]) -> Result<T, ProtocolError> {
    serde_json::from_slice(payload).map_err(|e| ProtocolError::BadPayload {
        frame,
        reason: e.to_string(),
    })
}

/// Decodes an OK payload into the op's reply type.
pub fn parse_reply<T: DeserializeOwned>(value: serde_json::Value) -> Result<T, ProtocolError> {
    serde_json::from_value(value).map_err(|e| ProtocolError::BadPayload {
        frame: FrameType::Ok,
        reason: e.to_string(),
    })
}

// ---------------------------------------------------------------------------------------
// Session and common replies

/// The agent's greeting, the first frame on every connection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// [`crate::params::PROTOCOL_VERSION`] of the agent.
    pub protocol: u32,
    /// `"mayfly-agent <version>"`.
    pub agent: String,
    /// The op names the agent implements.
    pub ops: Vec<String>,
}

/// An ERROR frame's payload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorReply {
    /// What went wrong, for a human.
    pub error: String,
    pub code: ErrorCode,
}

/// An OK reply without content (remove, mkdir).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Empty {}

/// A request without fields (identity, ping). Unknown fields are refused like elsewhere.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoFields {}

// ---------------------------------------------------------------------------------------
// Requests

/// A REQUEST frame: `{"op": "<name>", ...fields}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    Exec(ExecRequest),
    WriteFile(WriteFileRequest),
    ReadFile(ReadFileRequest),
    Stat(StatRequest),
    List(ListRequest),
    Remove(RemoveRequest),
    Mkdir(MkdirRequest),
    Refresh(RefreshRequest),
    Identity(NoFields),
    Ping(NoFields),
}

/// Why a REQUEST payload was refused; [`RequestError::code`] is the ERROR code to answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("the request is not a JSON object: {0}")]
    NotJson(String),
    #[error("the request has no \"op\" string naming the operation")]
    NoOp,
    #[error("unknown op {op:?}; this agent implements: {}", OPS.join(", "))]
    UnknownOp { op: String },
    #[error("bad {op} request: {reason}")]
    Invalid { op: String, reason: String },
}

impl RequestError {
    pub fn code(&self) -> ErrorCode {
        match self {
            RequestError::UnknownOp { .. } => ErrorCode::Unsupported,
            _ => ErrorCode::Invalid,
        }
    }
}

impl Request {
    /// Parses a REQUEST payload, telling an unknown op (unsupported) from bad fields
    /// (invalid), and checking each op's own rules (e.g. exec's argv XOR shell).
    pub fn parse(payload: &[u8]) -> Result<Request, RequestError> {
        let value: serde_json::Value =
            serde_json::from_slice(payload).map_err(|e| RequestError::NotJson(e.to_string()))?;
        let op = match value.as_object() {
            Some(map) => match map.get("op") {
                Some(serde_json::Value::String(op)) => op.clone(),
                _ => return Err(RequestError::NoOp),
            },
            None => return Err(RequestError::NotJson("not an object".into())),
        };
        if !OPS.contains(&op.as_str()) {
            return Err(RequestError::UnknownOp { op });
        }
        let invalid = |reason: String| RequestError::Invalid {
            op: op.clone(),
            reason,
        };
        let request: Request = serde_json::from_value(value).map_err(|e| invalid(e.to_string()))?;
        request.validate().map_err(invalid)?;
        Ok(request)
    }

    /// The op's name, as on the wire.
    pub fn op(&self) -> &'static str {
        match self {
            Request::Exec(_) => "exec",
            Request::WriteFile(_) => "write_file",
            Request::ReadFile(_) => "read_file",
            Request::Stat(_) => "stat",
            Request::List(_) => "list",
            Request::Remove(_) => "remove",
            Request::Mkdir(_) => "mkdir",
            Request::Refresh(_) => "refresh",
            Request::Identity(_) => "identity",
            Request::Ping(_) => "ping",
        }
    }

    /// The rules serde cannot express. Both ends call this: the client before sending, the
    /// agent on receipt.
    pub fn validate(&self) -> Result<(), String> {
        match self {
            Request::Exec(r) => r.validate(),
            Request::WriteFile(r) => {
                check_path(&r.path)?;
                check_mode(r.mode)
            }
            Request::ReadFile(r) => check_path(&r.path),
            Request::Stat(r) => check_path(&r.path),
            Request::List(r) => check_path(&r.path),
            Request::Remove(r) => {
                check_path(&r.path)?;
                if r.path.trim_end_matches('/').is_empty() {
                    return Err("refusing to remove /".into());
                }
                Ok(())
            }
            Request::Mkdir(r) => {
                check_path(&r.path)?;
                check_mode(r.mode)
            }
            Request::Refresh(r) => r.validate(),
            Request::Identity(_) | Request::Ping(_) => Ok(()),
        }
    }
}

fn no_nul(what: &str, s: &str) -> Result<(), String> {
    if s.contains('\0') {
        Err(format!("{what} contains a NUL byte"))
    } else {
        Ok(())
    }
}

fn check_path(path: &str) -> Result<(), String> {
    no_nul("path", path)?;
    if !path.starts_with('/') {
        return Err(format!("path {path:?} is not absolute"));
    }
    Ok(())
}

fn check_mode(mode: u32) -> Result<(), String> {
    if mode > 0o7777 {
        Err(format!(
            "mode {mode:#o} has bits beyond 0o7777 (give permission bits only)"
        ))
    } else {
        Ok(())
    }
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn yes() -> bool {
    true
}

fn default_file_mode() -> u32 {
    0o644
}

fn default_dir_mode() -> u32 {
    0o755
}

/// Whose identity an exec'd program runs with: a user name or a numeric uid.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum User {
    Uid(u32),
    Name(String),
}

impl Serialize for User {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            User::Uid(uid) => s.serialize_u32(*uid),
            User::Name(name) => s.serialize_str(name),
        }
    }
}

impl<'de> Deserialize<'de> for User {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<User, D::Error> {
        struct UserVisitor;
        impl Visitor<'_> for UserVisitor {
            type Value = User;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a user name or a numeric uid")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<User, E> {
                u32::try_from(v)
                    .map(User::Uid)
                    .map_err(|_| E::custom(format!("uid {v} is out of range")))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<User, E> {
                u32::try_from(v)
                    .map(User::Uid)
                    .map_err(|_| E::custom(format!("uid {v} is out of range")))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<User, E> {
                Ok(User::Name(v.to_owned()))
            }
        }
        d.deserialize_any(UserVisitor)
    }
}

impl From<&str> for User {
    fn from(name: &str) -> User {
        User::Name(name.to_owned())
    }
}

impl From<u32> for User {
    fn from(uid: u32) -> User {
        User::Uid(uid)
    }
}

/// Where an exec'd program's stdin comes from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StdinMode {
    /// `/dev/null`.
    #[default]
    None,
    /// STDIN frames from the host; an empty one is end of input.
    Stream,
}

impl StdinMode {
    fn is_none(&self) -> bool {
        *self == StdinMode::None
    }
}

/// `exec`: run a program.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    /// The program and its arguments; the program is looked up in PATH unless it has a `/`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub argv: Option<Vec<String>>,
    /// A command line for `/bin/sh -c`. Exactly one of `argv` and `shell` is given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shell: Option<String>,
    /// Added to (and overriding) the default environment.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Start from an empty environment instead of the default one.
    #[serde(default, skip_serializing_if = "is_false")]
    pub clear_env: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<User>,
    /// Kill the process group (SIGTERM, SIGKILL 2 s later) after this long.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "StdinMode::is_none")]
    pub stdin: StdinMode,
}

impl ExecRequest {
    /// Runs `argv` directly.
    pub fn argv<I, T>(argv: I) -> ExecRequest
    where
        I: IntoIterator<Item = T>,
        T: Into<String>,
    {
        ExecRequest {
            argv: Some(argv.into_iter().map(Into::into).collect()),
            ..ExecRequest::default()
        }
    }

    /// Runs `command` with `/bin/sh -c`.
    pub fn shell(command: impl Into<String>) -> ExecRequest {
        ExecRequest {
            shell: Some(command.into()),
            ..ExecRequest::default()
        }
    }

    pub fn with_env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.insert(key.into(), value.into());
        self
    }

    pub fn with_clear_env(mut self, clear: bool) -> Self {
        self.clear_env = clear;
        self
    }

    pub fn with_cwd(mut self, cwd: impl Into<String>) -> Self {
        self.cwd = Some(cwd.into());
        self
    }

    pub fn with_user(mut self, user: impl Into<User>) -> Self {
        self.user = Some(user.into());
        self
    }

    pub fn with_timeout_ms(mut self, timeout_ms: u64) -> Self {
        self.timeout_ms = Some(timeout_ms);
        self
    }

    pub fn validate(&self) -> Result<(), String> {
        match (&self.argv, &self.shell) {
            (Some(_), Some(_)) => return Err("give either argv or shell, not both".into()),
            (None, None) => return Err("give argv or shell".into()),
            (Some(argv), None) => {
                if argv.is_empty() || argv[0].is_empty() {
                    return Err("argv is empty: name a program".into());
                }
                for arg in argv {
                    no_nul("an argument", arg)?;
                }
            }
            (None, Some(shell)) => no_nul("shell", shell)?,
        }
        for (key, value) in &self.env {
            if key.is_empty() || key.contains('=') {
                return Err(format!("environment name {key:?} is empty or contains '='"));
            }
            no_nul("an environment name", key)?;
            no_nul("an environment value", value)?;
        }
        if let Some(cwd) = &self.cwd {
            no_nul("cwd", cwd)?;
        }
        if let Some(User::Name(name)) = &self.user {
            if name.is_empty() {
                return Err("user is empty".into());
            }
        }
        if self.timeout_ms == Some(0) {
            return Err("timeout_ms is 0; omit it for no timeout".into());
        }
        Ok(())
    }
}

/// A SIGNAL frame: deliver `signal` to the running program's process group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignalRequest {
    pub signal: i32,
}

/// `write_file`: followed by DATA frames from the host, an empty one ending the file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WriteFileRequest {
    pub path: String,
    /// Permission bits (default 0o644), applied exactly (not masked by a umask).
    #[serde(default = "default_file_mode")]
    pub mode: u32,
    /// Write a temporary file in the same directory, fsync, rename it over `path`.
    #[serde(default = "yes")]
    pub atomic: bool,
    /// Create missing parent directories (mode 0o755).
    #[serde(default)]
    pub mkdirs: bool,
}

/// `read_file`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReadFileRequest {
    pub path: String,
}

/// `stat`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StatRequest {
    pub path: String,
    /// Follow a final symlink (default true).
    #[serde(default = "yes")]
    pub follow: bool,
}

/// `list`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListRequest {
    pub path: String,
}

/// `remove`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemoveRequest {
    pub path: String,
    /// Remove a directory with its contents.
    #[serde(default)]
    pub recursive: bool,
}

/// `mkdir`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MkdirRequest {
    pub path: String,
    /// Permission bits of the new directory (default 0o755), applied exactly.
    #[serde(default = "default_dir_mode")]
    pub mode: u32,
    /// Create missing parents, and succeed if the directory exists (like `mkdir -p`).
    #[serde(default)]
    pub parents: bool,
}

/// What happened to the VM before a refresh.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RefreshEvent {
    Boot,
    Restore,
    Fork,
}

impl RefreshEvent {
    pub fn as_str(self) -> &'static str {
        match self {
            RefreshEvent::Boot => "boot",
            RefreshEvent::Restore => "restore",
            RefreshEvent::Fork => "fork",
        }
    }
}

/// Who this VM is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Identity {
    pub name: String,
    /// The clone's index among its siblings; null for a VM that is not a clone.
    #[serde(default)]
    pub index: Option<u64>,
    /// The name of the VM it was forked from; null for an original.
    #[serde(default)]
    pub parent: Option<String>,
    /// How many forks deep this VM is (0 for an original).
    pub generation: u64,
}

/// The least and most entropy a refresh carries, in bytes.
pub const REFRESH_ENTROPY_MIN: usize = 32;
pub const REFRESH_ENTROPY_MAX: usize = 512;

/// `refresh`: sent by the VMM after every restore and in every clone.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RefreshRequest {
    pub event: RefreshEvent,
    /// The host's CLOCK_REALTIME, in nanoseconds since the Unix epoch.
    pub time_unix_ns: u64,
    /// Base64 of 32..=512 random bytes; see [`RefreshRequest::entropy_bytes`].
    pub entropy: String,
    /// A valid DNS label.
    pub hostname: String,
    pub identity: Identity,
    /// The MAC the VM's virtio NIC must have (`02:6d:...`, lower-case hex): a clone's own,
    /// which its guest, which learnt its parent's, takes on now. Absent: the VM has no NIC (or
    /// the VMM is older), nothing to change.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
}

impl RefreshRequest {
    /// Builds a request, base64-encoding `entropy`.
    pub fn new(
        event: RefreshEvent,
        time_unix_ns: u64,
        entropy: &[u8],
        hostname: impl Into<String>,
        identity: Identity,
    ) -> RefreshRequest {
        RefreshRequest {
            event,
            time_unix_ns,
            entropy: crate::base64::encode(entropy),
            hostname: hostname.into(),
            identity,
            mac: None,
        }
    }

    /// The request with the NIC's MAC to set (see [`RefreshRequest::mac`]).
    pub fn with_mac(mut self, mac: [u8; 6]) -> RefreshRequest {
        self.mac = Some(format_mac(mac));
        self
    }

    /// The MAC to set, parsed.
    pub fn mac_bytes(&self) -> Result<Option<[u8; 6]>, String> {
        self.mac.as_deref().map(parse_mac).transpose()
    }

    /// The decoded entropy, checked for length.
    pub fn entropy_bytes(&self) -> Result<Vec<u8>, String> {
        let bytes = crate::base64::decode(&self.entropy).map_err(|e| format!("entropy: {e}"))?;
        if !(REFRESH_ENTROPY_MIN..=REFRESH_ENTROPY_MAX).contains(&bytes.len()) {
            return Err(format!(
                "entropy is {} bytes; give {REFRESH_ENTROPY_MIN} to {REFRESH_ENTROPY_MAX}",
                bytes.len()
            ));
        }
        Ok(bytes)
    }

    pub fn validate(&self) -> Result<(), String> {
        self.entropy_bytes()?;
        self.mac_bytes()?;
        if !is_dns_label(&self.hostname) {
            return Err(format!(
                "hostname {:?} is not a DNS label (1-63 letters, digits and '-', \
                 not starting or ending with '-')",
                self.hostname
            ));
        }
        no_nul("identity name", &self.identity.name)?;
        if let Some(parent) = &self.identity.parent {
            no_nul("identity parent", parent)?;
        }
        Ok(())
    }
}

/// A MAC as `02:6d:66:00:00:01`.
pub fn format_mac(mac: [u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// A MAC from `02:6d:66:00:00:01` (either case): six two-digit hex bytes, unicast (the low bit
/// of the first byte clear: a NIC cannot take a multicast address).
pub fn parse_mac(text: &str) -> Result<[u8; 6], String> {
    let bad = || format!("mac {text:?} is not a unicast MAC like 02:6d:66:00:00:01");
    let mut mac = [0u8; 6];
    let mut parts = text.split(':');
    for byte in &mut mac {
        let part = parts.next().ok_or_else(bad)?;
        // from_str_radix alone would take a sign ("+2").
        if part.len() != 2 || !part.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad());
        }
        *byte = u8::from_str_radix(part, 16).map_err(|_| bad())?;
    }
    if parts.next().is_some() || mac[0] & 1 != 0 {
        return Err(bad());
    }
    Ok(mac)
}

/// Whether `s` is a DNS label (RFC 1123): 1-63 ASCII letters, digits and hyphens, not
/// beginning or ending with a hyphen.
pub fn is_dns_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

// ---------------------------------------------------------------------------------------
// Replies

/// STARTED: the program is running.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Started {
    pub pid: u32,
}

/// EXIT: how the program ended. Exactly one of `exit_code` and `signal` is set, unless the
/// program never started (then `exit_code` is 127 or 126 and `error` says why).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ExitRecord {
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    /// The agent killed it because `timeout_ms` passed.
    pub timed_out: bool,
    pub wall_ms: f64,
    pub user_cpu_ms: f64,
    pub sys_cpu_ms: f64,
    pub max_rss_kib: u64,
    pub error: Option<String>,
}

impl ExitRecord {
    /// Exited with status 0.
    pub fn success(&self) -> bool {
        self.exit_code == Some(0)
    }
}

/// write_file's OK.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteFileReply {
    pub bytes: u64,
}

/// read_file's OK, before the DATA frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadFileReply {
    /// The size when opened; the DATA that follows is what was read (a file that is being
    /// written to, or a /proc file, may differ).
    pub size: u64,
    pub mode: u32,
}

/// What kind of file a path names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileType {
    File,
    Dir,
    Symlink,
    Other,
}

/// stat's OK.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatReply {
    #[serde(rename = "type")]
    pub file_type: FileType,
    pub size: u64,
    /// Permission bits (`st_mode & 0o7777`).
    pub mode: u32,
    pub mtime_ms: i64,
    pub uid: u32,
    pub gid: u32,
}

/// One entry of an ENTRIES frame (symlinks are not followed).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirEntry {
    pub name: String,
    #[serde(rename = "type")]
    pub file_type: FileType,
    pub size: u64,
    pub mode: u32,
    pub mtime_ms: i64,
}

/// list's OK, after the ENTRIES frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListReply {
    pub count: u64,
}

/// One hook script's result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HookReport {
    pub name: String,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub timed_out: bool,
    /// The first 4 KiB of its stdout and stderr, interleaved as written.
    pub output: String,
}

/// refresh's OK.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RefreshReply {
    pub clock_set: bool,
    /// How many entropy bytes were mixed into the kernel's pool.
    pub entropy_bytes: u64,
    pub hostname_set: bool,
    /// Whether the NIC took the MAC the request asked for (false: none asked, or it failed:
    /// see `warnings`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub mac_set: bool,
    /// In the order they ran.
    pub hooks: Vec<HookReport>,
    /// Why a system change did not happen (e.g. clock_settime failed), if one did not.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

/// ping's OK.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PingReply {
    /// The guest's uptime (CLOCK_BOOTTIME), in milliseconds.
    pub uptime_ms: u64,
    pub protocol: u32,
    pub agent: String,
}

/// Reads and decodes one message; `Ok(None)` at a clean end of stream.
pub fn read_message<R: std::io::Read + ?Sized>(r: &mut R) -> Result<Option<Message>, FrameError> {
    match crate::frame::read_frame(r)? {
        Some(frame) => Ok(Some(Message::from_frame(frame)?)),
        None => Ok(None),
    }
}

/// Encodes and writes one message.
pub fn write_message<W: std::io::Write + ?Sized>(
    w: &mut W,
    msg: &Message,
) -> Result<(), FrameError> {
    let buf = msg.encode()?;
    w.write_all(&buf)?;
    w.flush()?;
    Ok(())
}
