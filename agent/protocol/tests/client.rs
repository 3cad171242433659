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
