//! The `agent_frames` fuzz target's seeds (`fuzz/corpus/agent_frames/seed-*`), made here from
//! the real encoder so that they stay in the current wire format, and checked to reach the end
//! of each client call: a seed the client refuses would only fuzz the first frame's header.
//!
//! A seed is the target's input: one byte that picks the client call (`op % 8`, as in
//! `fuzz/fuzz_targets/agent_frames.rs`), then what an agent sends for it. When the protocol
//! changes, `MAYFLY_BLESS=1 cargo test -p mayfly-agent-protocol --test fuzz_seeds` writes them
//! again; without it, a seed on disk that differs from the one made here fails the test.

use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use mayfly_agent_protocol::{
    AgentClient, DirEntry, Empty, ErrorCode, FileType, Hello, Identity, ListReply, Message,
    PingReply, ReadFileReply, StatReply, PROTOCOL_VERSION,
};

/// A connection whose peer sent `data` and then closed; what we write goes nowhere.
struct Peer<'a> {
    data: &'a [u8],
}

impl Read for Peer<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.data.read(buf)
    }
}

impl Write for Peer<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn hello() -> Message {
    Message::Hello(Hello {
        protocol: PROTOCOL_VERSION,
        agent: "mayfly-agent 0.0.0 (seed)".into(),
        ops: [
            "exec",
            "read_file",
            "stat",
            "list",
            "identity",
            "ping",
            "mkdir",
            "remove",
        ]
        .map(String::from)
        .to_vec(),
    })
}

fn entry(name: &str, file_type: FileType, size: u64) -> DirEntry {
    DirEntry {
        name: name.into(),
        file_type,
        size,
        mode: 0o644,
        mtime_ms: 1_700_000_000_000,
    }
}

/// `(file name, op byte, messages the agent sends)`.
fn seeds() -> Vec<(&'static str, u8, Vec<Message>)> {
    let ok = |reply: &dyn erased::Reply| reply.message();
    vec![
        ("seed-hello", 0, vec![hello()]),
        (
            "seed-read-file",
            1,
            vec![
                hello(),
                ok(&ReadFileReply {
                    size: 11,
                    mode: 0o644,
                }),
                Message::Data(b"hello ".to_vec()),
                Message::Data(b"world".to_vec()),
                Message::Data(Vec::new()),
            ],
        ),
        (
            "seed-read-file-error-midway",
            1,
            vec![
                hello(),
                ok(&ReadFileReply {
                    size: 4,
                    mode: 0o600,
                }),
                Message::Data(b"ab".to_vec()),
                Message::error(ErrorCode::Io, "the file went away"),
            ],
        ),
        (
            "seed-stat",
            2,
            vec![
                hello(),
                ok(&StatReply {
                    file_type: FileType::File,
                    size: 4096,
                    mode: 0o755,
                    mtime_ms: 1_700_000_000_000,
                    uid: 0,
                    gid: 0,
                }),
            ],
        ),
        (
            "seed-list",
            3,
            vec![
                hello(),
                Message::Entries(vec![
                    entry("a", FileType::File, 1),
                    entry("b", FileType::Dir, 4096),
                ]),
                Message::Entries(vec![entry("c", FileType::Symlink, 3)]),
                ok(&ListReply { count: 3 }),
            ],
        ),
        (
            "seed-identity",
            4,
            vec![
                hello(),
                ok(&Identity {
                    name: "clone-3".into(),
                    index: Some(3),
                    parent: Some("base".into()),
                    generation: 1,
                }),
            ],
        ),
        (
            "seed-ping",
            5,
            vec![
                hello(),
                ok(&PingReply {
                    uptime_ms: 1234,
                    protocol: PROTOCOL_VERSION,
                    agent: "mayfly-agent 0.0.0 (seed)".into(),
                }),
            ],
        ),
        ("seed-mkdir", 6, vec![hello(), ok(&Empty {})]),
        ("seed-remove", 7, vec![hello(), ok(&Empty {})]),
        (
            "seed-remove-refused",
            7,
            vec![hello(), Message::error(ErrorCode::NotFound, "no such file")],
        ),
    ]
}

/// An OK message from any reply type, without naming each in `seeds`.
mod erased {
    use mayfly_agent_protocol::Message;
    use serde::Serialize;

    pub trait Reply {
        fn message(&self) -> Message;
    }

    impl<T: Serialize> Reply for T {
        fn message(&self) -> Message {
            Message::ok(self).expect("a reply type encodes")
        }
    }
}

fn seed_bytes(op: u8, messages: &[Message]) -> Vec<u8> {
    let mut bytes = vec![op];
    for message in messages {
        bytes.extend(message.encode().expect("a seed message encodes"));
    }
    bytes
}

/// Runs the call `op` picks on `stream`, as the fuzz target does; whether it succeeded.
fn call(op: u8, stream: &[u8]) -> bool {
    let mut client = AgentClient::new(Peer { data: stream });
    match op % 8 {
        0 => client.hello().is_ok(),
        1 => client.read_file("/f", io::sink()).is_ok(),
        2 => client.stat("/f", true).is_ok(),
        3 => client.list("/").is_ok(),
        4 => client.identity().is_ok(),
        5 => client.ping().is_ok(),
        6 => client.mkdir("/d", 0o755, true).is_ok(),
        _ => client.remove("/f", true).is_ok(),
    }
}

fn corpus_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/agent_frames")
}

#[test]
fn each_seed_reaches_the_end_of_its_call() {
    for (name, op, messages) in seeds() {
        let bytes = seed_bytes(op, &messages);
        let refused = name.ends_with("-refused") || name.ends_with("-error-midway");
        assert_eq!(
            call(op, &bytes[1..]),
            !refused,
            "{name}: the client should {} it",
            if refused { "refuse" } else { "accept" }
        );
        // One byte short, the call cannot succeed: the seed's last frame is read to its end.
        assert!(
            !call(op, &bytes[1..bytes.len() - 1]),
            "{name}: cut by one byte, still accepted"
        );
    }
}

#[test]
fn the_seeds_on_disk_are_the_current_ones() {
    let dir = corpus_dir();
    let bless = std::env::var_os("MAYFLY_BLESS").is_some_and(|v| v == "1");
    if bless {
        std::fs::create_dir_all(&dir).unwrap();
    }
    let mut stale = Vec::new();
    for (name, op, messages) in seeds() {
        let bytes = seed_bytes(op, &messages);
        let path = dir.join(name);
        if bless {
            std::fs::write(&path, &bytes).unwrap();
        } else if std::fs::read(&path).ok().as_deref() != Some(&bytes[..]) {
            stale.push(name);
        }
    }
    assert!(
        stale.is_empty(),
        "fuzz seeds missing or stale in {}: {stale:?}; write them again with \
         MAYFLY_BLESS=1 cargo test -p mayfly-agent-protocol --test fuzz_seeds",
        dir.display()
    );
}
