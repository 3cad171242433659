//! The client against scripted fake agents on a socket pair: the session rules, version
//! checks and distrust of the peer.

use std::io::{Cursor, Write};
use std::os::unix::net::UnixStream;
use std::thread;

use mayfly_agent_protocol::*;

fn hello(protocol: u32) -> Message {
    Message::Hello(Hello {
        protocol,
        agent: "mayfly-agent test".into(),
        ops: OPS.iter().map(|s| s.to_string()).collect(),
    })
}

/// Runs `agent` on one end of a socket pair and returns a client on the other.
fn with_fake_agent(
    agent: impl FnOnce(UnixStream) + Send + 'static,
) -> (AgentClient<UnixStream>, thread::JoinHandle<()>) {
    let (host, guest) = UnixStream::pair().unwrap();
    let handle = thread::spawn(move || agent(guest));
    (AgentClient::new(host), handle)
}

fn expect_request(s: &mut UnixStream) -> Request {
    match read_message(s).unwrap() {
        Some(Message::Request(r)) => r,
        other => panic!("expected a request, got {other:?}"),
    }
}

#[test]
fn ping_round_trip() {
    let (client, agent) = with_fake_agent(|mut s| {
        write_message(&mut s, &hello(1)).unwrap();
        assert_eq!(expect_request(&mut s), Request::Ping(NoFields {}));
        let reply = PingReply {
            uptime_ms: 5,
            protocol: 1,
            agent: "x".into(),
        };
        write_message(&mut s, &Message::ok(&reply).unwrap()).unwrap();
    });
    let reply = client.ping().unwrap();
    assert_eq!(reply.uptime_ms, 5);
    agent.join().unwrap();
}

#[test]
fn version_mismatch_is_reported() {
    let (mut client, agent) = with_fake_agent(|mut s| {
        write_message(&mut s, &hello(2)).unwrap();
    });
    match client.hello() {
        Err(Error::VersionMismatch { ours, theirs, .. }) => {
            assert_eq!((ours, theirs), (1, 2))
        }
        other => panic!("{other:?}"),
    }
    agent.join().unwrap();
}

#[test]
fn busy_agent_is_an_agent_error() {
    let (client, agent) = with_fake_agent(|mut s| {
        write_message(&mut s, &Message::error(ErrorCode::Busy, "too many")).unwrap();
    });
    let e = client.ping().unwrap_err();
    assert_eq!(e.agent_code(), Some(ErrorCode::Busy), "{e}");
    agent.join().unwrap();
}

#[test]
fn silent_close_is_a_protocol_error() {
    let (client, agent) = with_fake_agent(drop);
    let e = client.ping().unwrap_err();
    assert!(
        matches!(e, Error::Protocol(ProtocolError::Closed(_))),
        "{e}"
    );
    agent.join().unwrap();
}

#[test]
fn oversized_frame_from_the_agent_is_refused() {
    let (client, agent) = with_fake_agent(|mut s| {
        write_message(&mut s, &hello(1)).unwrap();
        let _ = expect_request(&mut s);
        // Claims 4 GiB; the client must refuse without trying to read it.
        let _ = s.write_all(&u32::MAX.to_be_bytes());
    });
    let e = client.ping().unwrap_err();
    assert!(
        matches!(e, Error::Protocol(ProtocolError::FrameTooLarge(_))),
        "{e}"
    );
    agent.join().unwrap();
}

#[test]
fn out_of_order_frames_are_refused() {
    // Output before STARTED is not allowed.
    let (client, agent) = with_fake_agent(|mut s| {
        write_message(&mut s, &hello(1)).unwrap();
        let _ = expect_request(&mut s);
        write_message(&mut s, &Message::Stdout(b"x".to_vec())).unwrap();
    });
    let e = client
        .exec(
            &ExecRequest::argv(["true"]),
            None::<Cursor<Vec<u8>>>,
            |_| {},
            |_| {},
        )
        .unwrap_err();
    assert!(
        matches!(e, Error::Protocol(ProtocolError::Unexpected { .. })),
        "{e}"
    );
    agent.join().unwrap();
}

#[test]
fn invalid_requests_are_refused_locally() {
    let (client, agent) = with_fake_agent(|mut s| {
        // The client refuses before even reading HELLO, so this may hit a closed socket.
        let _ = write_message(&mut s, &hello(1));
        // The client must not send anything: the next read sees the close.
        assert!(matches!(
            read_message(&mut s),
            Ok(None) | Err(FrameError::Io(_))
        ));
    });
    let bad = ExecRequest {
        argv: Some(vec!["a".into()]),
        shell: Some("b".into()),
        ..Default::default()
    };
    let e = client
        .exec(&bad, None::<Cursor<Vec<u8>>>, |_| {}, |_| {})
        .unwrap_err();
    assert!(matches!(e, Error::InvalidRequest(_)), "{e}");
    agent.join().unwrap();
}

#[test]
fn exec_streams_stdin_and_output() {
    let (client, agent) = with_fake_agent(|mut s| {
        write_message(&mut s, &hello(1)).unwrap();
        match expect_request(&mut s) {
            Request::Exec(r) => assert_eq!(r.stdin, StdinMode::Stream),
            other => panic!("{other:?}"),
        }
        write_message(&mut s, &Message::Started(Started { pid: 9 })).unwrap();
        // Echo stdin back as stdout until its end.
        loop {
            match read_message(&mut s).unwrap() {
                Some(Message::Stdin(b)) if b.is_empty() => break,
                Some(Message::Stdin(b)) => write_message(&mut s, &Message::Stdout(b)).unwrap(),
                other => panic!("{other:?}"),
            }
        }
        write_message(&mut s, &Message::Stderr(b"done".to_vec())).unwrap();
        let exit = ExitRecord {
            exit_code: Some(0),
            ..Default::default()
        };
        write_message(&mut s, &Message::Exit(exit)).unwrap();
    });
    let input: Vec<u8> = (0..200_000u32).map(|i| i as u8).collect();
    let out = client
        .exec_output(&ExecRequest::argv(["cat"]), Some(input.clone()))
        .unwrap();
    assert!(out.exit.success());
    assert_eq!(out.stdout, input);
    assert_eq!(out.stderr, b"done");
    agent.join().unwrap();
}

#[test]
fn signaller_only_works_while_running() {
    let (mut client, agent) = with_fake_agent(|mut s| {
        write_message(&mut s, &hello(1)).unwrap();
        let _ = expect_request(&mut s);
        write_message(&mut s, &Message::Started(Started { pid: 9 })).unwrap();
        match read_message(&mut s).unwrap() {
            Some(Message::Signal(SignalRequest { signal: 15 })) => {}
            other => panic!("{other:?}"),
        }
        let exit = ExitRecord {
            signal: Some(15),
            ..Default::default()
        };
        write_message(&mut s, &Message::Exit(exit)).unwrap();
    });
    let signaller = client.signaller().unwrap();
    assert!(matches!(signaller.signal(15), Err(Error::NotRunning)));
    let sender = signaller.clone();
    let t = thread::spawn(move || {
        while !sender.is_running() {
            thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(sender.pid(), Some(9));
        sender.signal(15).unwrap();
    });
    let exit = client
        .exec(
            &ExecRequest::argv(["sleep", "9"]),
            None::<Cursor<Vec<u8>>>,
            |_| {},
            |_| {},
        )
        .unwrap();
    assert_eq!(exit.signal, Some(15));
    t.join().unwrap();
    assert!(matches!(signaller.signal(15), Err(Error::NotRunning)));
    agent.join().unwrap();
}

#[test]
fn list_checks_the_count() {
    let (client, agent) = with_fake_agent(|mut s| {
        write_message(&mut s, &hello(1)).unwrap();
        let _ = expect_request(&mut s);
        let e = DirEntry {
            name: "a".into(),
            file_type: FileType::File,
            size: 0,
            mode: 0o644,
            mtime_ms: 0,
        };
        write_message(&mut s, &Message::Entries(vec![e])).unwrap();
        let reply = Message::ok(&ListReply { count: 2 }).unwrap();
        write_message(&mut s, &reply).unwrap();
    });
    let e = client.list("/").unwrap_err();
    assert!(e.to_string().contains("counted 2"), "{e}");
    agent.join().unwrap();
}

#[test]
fn write_file_reports_the_agents_early_error() {
    let (client, agent) = with_fake_agent(|mut s| {
        write_message(&mut s, &hello(1)).unwrap();
        let _ = expect_request(&mut s);
        write_message(
            &mut s,
            &Message::error(ErrorCode::NotFound, "no such directory"),
        )
        .unwrap();
        // Close without reading the data, as the agent does after its grace period.
    });
    let data = Cursor::new(vec![0u8; 8 << 20]);
    let e = client
        .write_file("/x/y", &WriteFileOptions::default(), data)
        .unwrap_err();
    assert_eq!(e.agent_code(), Some(ErrorCode::NotFound), "{e}");
    agent.join().unwrap();
}

fn entry(name: String) -> DirEntry {
    DirEntry {
        name,
        file_type: FileType::File,
        size: 0,
        mode: 0o644,
        mtime_ms: 0,
    }
}

/// An agent that answers a list with `batches` ENTRIES frames of `per` entries, then OK,
/// stopping quietly when the host stops reading.
fn listing_agent(batches: usize, per: usize) -> impl FnOnce(UnixStream) + Send + 'static {
    move |mut s| {
        write_message(&mut s, &hello(1)).unwrap();
        let _ = expect_request(&mut s);
        for b in 0..batches {
            let batch = (0..per).map(|i| entry(format!("{b:04}-{i:04}"))).collect();
            if write_message(&mut s, &Message::Entries(batch)).is_err() {
                return;
            }
        }
        let count = (batches * per) as u64;
        let _ = write_message(&mut s, &Message::ok(&ListReply { count }).unwrap());
    }
}

#[test]
fn a_listing_past_its_limits_is_cut_and_says_so() {
    // By entries: 10 of 30 kept; the reading stops at the first entry past them.
    let (client, agent) = with_fake_agent(listing_agent(3, 10));
    let limits = ListLimits {
        max_entries: 10,
        max_bytes: usize::MAX,
    };
    let listing = client.list_limited("/", limits).unwrap();
    assert!(listing.truncated);
    assert_eq!(listing.entries.len(), 10);
    assert_eq!(listing.received, 20, "two frames read, the second not kept");
    agent.join().unwrap();

    // By bytes: what the kept entries take in memory, names included.
    let (client, agent) = with_fake_agent(listing_agent(3, 10));
    let one = entry_bytes(&entry("0000-0000".into()));
    let limits = ListLimits {
        max_entries: usize::MAX,
        max_bytes: one * 15,
    };
    let listing = client.list_limited("/", limits).unwrap();
    assert!(listing.truncated);
    assert_eq!(listing.entries.len(), 15);
    assert_eq!(listing.received, 20, "two frames read, the second cut");
    assert!(listing.entries.windows(2).all(|w| w[0].name <= w[1].name));
    agent.join().unwrap();

    // Within the limits: whole, checked against the agent's count, not truncated.
    let (client, agent) = with_fake_agent(listing_agent(3, 10));
    let listing = client.list_limited("/", ListLimits::default()).unwrap();
    assert!(!listing.truncated);
    assert_eq!((listing.entries.len(), listing.received), (30, 30));
    agent.join().unwrap();
}

#[test]
fn a_listing_past_the_default_limits_is_an_error_not_a_growing_vector() {
    let limits = ListLimits::default();
    let per = 10_000;
    let (client, agent) = with_fake_agent(listing_agent(limits.max_entries / per + 1, per));
    let e = client.list("/").unwrap_err();
    assert!(matches!(e, Error::TooLarge { .. }), "{e}");
    assert!(e.to_string().contains("list_limited"), "{e}");
    agent.join().unwrap();
}

#[test]
fn collected_output_is_bounded() {
    let (client, agent) = with_fake_agent(|mut s| {
        write_message(&mut s, &hello(1)).unwrap();
        let _ = expect_request(&mut s);
        write_message(&mut s, &Message::Started(Started { pid: 9 })).unwrap();
        for _ in 0..4 {
            write_message(&mut s, &Message::Stdout(vec![b'o'; 1000])).unwrap();
            write_message(&mut s, &Message::Stderr(vec![b'e'; 10])).unwrap();
        }
        write_message(&mut s, &Message::Exit(ExitRecord::default())).unwrap();
    });
    let out = client
        .exec_output_limited(&ExecRequest::argv(["x"]), None, 2500)
        .unwrap();
    assert_eq!(out.stdout.len(), 2500);
    assert_eq!(out.stdout_dropped, 1500);
    assert_eq!(out.stderr.len(), 40);
    assert_eq!(out.stderr_dropped, 0);
    agent.join().unwrap();
}

#[test]
fn a_hello_past_its_bound_is_refused() {
    let (client, agent) = with_fake_agent(|mut s| {
        let big = Message::Hello(Hello {
            protocol: 1,
            agent: "x".repeat(MAX_HELLO),
            ops: vec![],
        });
        let _ = write_message(&mut s, &big);
    });
    let e = client.ping().unwrap_err();
    assert!(e.to_string().contains("HELLO"), "{e}");
    agent.join().unwrap();
}

#[test]
fn an_ok_that_is_not_the_ops_reply_is_a_protocol_error() {
    let (client, agent) = with_fake_agent(|mut s| {
        write_message(&mut s, &hello(1)).unwrap();
        let _ = expect_request(&mut s);
        let json = format!("[{}0]", "0,".repeat(1000));
        s.write_all(&encode_frame(FrameType::Ok, json.as_bytes()).unwrap())
            .unwrap();
    });
    let e = client.stat("/", true).unwrap_err();
    assert!(
        matches!(e, Error::Protocol(ProtocolError::BadPayload { .. })),
        "{e}"
    );
    agent.join().unwrap();
}
