//! The codec: every message round-trips, and malformed input is a typed error, never a panic.

use std::io::Cursor;

use mayfly_agent_protocol::*;

fn frame_bytes(len: u32, rest: &[u8]) -> Vec<u8> {
    let mut v = len.to_be_bytes().to_vec();
    v.extend_from_slice(rest);
    v
}

fn read_err(bytes: &[u8]) -> FrameError {
    match read_frame(&mut Cursor::new(bytes.to_vec())) {
        Ok(f) => panic!("expected an error, read {f:?}"),
        Err(e) => e,
    }
}

fn identity() -> Identity {
    Identity {
        name: "vm-3".into(),
        index: Some(3),
        parent: Some("vm".into()),
        generation: 1,
    }
}

fn all_messages() -> Vec<Message> {
    vec![
        Message::Hello(Hello {
            protocol: 1,
            agent: "mayfly-agent 0.1.0".into(),
            ops: OPS.iter().map(|s| s.to_string()).collect(),
        }),
        Message::Request(Request::Exec(
            ExecRequest::argv(["ls", "-l"])
                .with_env("A", "b")
                .with_cwd("/tmp")
                .with_user("nobody")
                .with_timeout_ms(5),
        )),
        Message::Request(Request::Exec(ExecRequest::shell("echo hi").with_user(1000))),
        Message::Request(Request::WriteFile(WriteFileRequest {
            path: "/a".into(),
            mode: 0o600,
            atomic: false,
            mkdirs: true,
        })),
        Message::Request(Request::ReadFile(ReadFileRequest { path: "/a".into() })),
        Message::Request(Request::Stat(StatRequest {
            path: "/a".into(),
            follow: false,
        })),
        Message::Request(Request::List(ListRequest { path: "/".into() })),
        Message::Request(Request::Remove(RemoveRequest {
            path: "/a".into(),
            recursive: true,
        })),
        Message::Request(Request::Mkdir(MkdirRequest {
            path: "/a/b".into(),
            mode: 0o700,
            parents: true,
        })),
        Message::Request(Request::Refresh(RefreshRequest::new(
            RefreshEvent::Fork,
            1_700_000_000_000_000_000,
            &[7u8; 32],
            "vm-3",
            identity(),
        ))),
        Message::Request(Request::Identity(NoFields {})),
        Message::Request(Request::Ping(NoFields {})),
        Message::Stdin(b"input".to_vec()),
        Message::Stdin(Vec::new()),
        Message::Stdout(vec![0, 1, 2, 255]),
        Message::Stderr(b"oops".to_vec()),
        Message::Exit(ExitRecord {
            exit_code: Some(3),
            signal: None,
            timed_out: false,
            wall_ms: 1.5,
            user_cpu_ms: 0.25,
            sys_cpu_ms: 0.5,
            max_rss_kib: 1024,
            error: None,
        }),
        Message::Signal(SignalRequest { signal: 15 }),
        Message::Ok(serde_json::json!({"bytes": 5})),
        Message::error(ErrorCode::NotFound, "no such file: /a"),
        Message::Data(vec![9; 100]),
        Message::Data(Vec::new()),
        Message::Started(Started { pid: 42 }),
        Message::Entries(vec![DirEntry {
            name: "a".into(),
            file_type: FileType::Symlink,
            size: 1,
            mode: 0o777,
            mtime_ms: -5,
        }]),
    ]
}

#[test]
fn every_message_round_trips() {
    let mut stream = Vec::new();
    for msg in all_messages() {
        write_message(&mut stream, &msg).unwrap();
    }
    let mut r = Cursor::new(stream);
    for msg in all_messages() {
        assert_eq!(read_message(&mut r).unwrap(), Some(msg));
    }
    assert_eq!(read_message(&mut r).unwrap(), None, "clean end of stream");
}

#[test]
fn frame_layout_is_big_endian_length_then_type() {
    let bytes = encode_frame(FrameType::Stdout, b"hi").unwrap();
    assert_eq!(bytes, [0, 0, 0, 3, 0x04, b'h', b'i']);
    let bytes = Message::Data(Vec::new()).encode().unwrap();
    assert_eq!(bytes, [0, 0, 0, 1, 0x0A]);
}

#[test]
fn type_bytes_match_the_documentation() {
    let expected = [
        (0x01, "HELLO"),
        (0x02, "REQUEST"),
        (0x03, "STDIN"),
        (0x04, "STDOUT"),
        (0x05, "STDERR"),
        (0x06, "EXIT"),
        (0x07, "SIGNAL"),
        (0x08, "OK"),
        (0x09, "ERROR"),
        (0x0A, "DATA"),
        (0x0B, "STARTED"),
        (0x0C, "ENTRIES"),
    ];
    for (byte, name) in expected {
        let t = FrameType::from_byte(byte).unwrap();
        assert_eq!(t.as_byte(), byte);
        assert_eq!(t.name(), name);
    }
    assert_eq!(FrameType::from_byte(0), None);
    assert_eq!(FrameType::from_byte(0x0D), None);
}

#[test]
fn zero_length_is_an_error() {
    let e = read_err(&frame_bytes(0, &[]));
    assert!(
        matches!(e, FrameError::Protocol(ProtocolError::EmptyFrame)),
        "{e}"
    );
}

#[test]
fn huge_length_is_refused_before_reading_or_allocating() {
    // Only the header is present: the reader must refuse it from the length alone.
    for len in [MAX_FRAME as u32 + 1, u32::MAX] {
        let e = read_err(&frame_bytes(len, &[]));
        assert!(
            matches!(e, FrameError::Protocol(ProtocolError::FrameTooLarge(l)) if l == len as u64),
            "{e}"
        );
    }
}

#[test]
fn the_largest_frame_is_accepted() {
    let payload = vec![7u8; MAX_PAYLOAD];
    let bytes = encode_frame(FrameType::Data, &payload).unwrap();
    let frame = read_frame(&mut Cursor::new(bytes)).unwrap().unwrap();
    assert_eq!(frame.payload.len(), MAX_PAYLOAD);
    let too_big = vec![7u8; MAX_PAYLOAD + 1];
    assert!(matches!(
        encode_frame(FrameType::Data, &too_big),
        Err(ProtocolError::PayloadTooLarge { .. })
    ));
}

#[test]
fn truncated_frames_are_errors() {
    let whole = encode_frame(FrameType::Stdout, b"hello").unwrap();
    for cut in 1..whole.len() {
        let e = read_err(&whole[..cut]);
        assert!(
            matches!(e, FrameError::Protocol(ProtocolError::Truncated)),
            "cut at {cut}: {e}"
        );
    }
}

#[test]
fn unknown_type_is_an_error() {
    for t in [0x00u8, 0x0D, 0x7F, 0xFF] {
        let e = read_err(&frame_bytes(1, &[t]));
        assert!(
            matches!(e, FrameError::Protocol(ProtocolError::UnknownType(b)) if b == t),
            "{e}"
        );
    }
}

fn decode_err(kind: FrameType, payload: &[u8]) -> ProtocolError {
    match Message::from_frame(Frame {
        kind,
        payload: payload.to_vec(),
    }) {
        Ok(m) => panic!("expected an error, decoded {m:?}"),
        Err(e) => e,
    }
}

#[test]
fn bad_json_is_an_error() {
    let json_types = [
        FrameType::Hello,
        FrameType::Request,
        FrameType::Exit,
        FrameType::Signal,
        FrameType::Ok,
        FrameType::Error,
        FrameType::Started,
        FrameType::Entries,
    ];
    for kind in json_types {
        for payload in [&b""[..], b"{", b"\xff\xfe", b"[1,2", b"nul"] {
            let e = decode_err(kind, payload);
            assert!(
                matches!(e, ProtocolError::BadPayload { frame, .. } if frame == kind),
                "{kind} {payload:?}: {e}"
            );
        }
    }
}

#[test]
fn wrong_field_types_are_errors() {
    let e = decode_err(FrameType::Started, br#"{"pid": "one"}"#);
    assert!(matches!(e, ProtocolError::BadPayload { .. }), "{e}");
    let e = decode_err(FrameType::Error, br#"{"error": "x", "code": 5}"#);
    assert!(matches!(e, ProtocolError::BadPayload { .. }), "{e}");
    let e = decode_err(FrameType::Exit, br#"{"exit_code": 0}"#);
    assert!(
        matches!(e, ProtocolError::BadPayload { .. }),
        "missing fields: {e}"
    );
}

#[test]
fn requests_refuse_unknown_fields() {
    let cases: &[&[u8]] = &[
        br#"{"op":"exec","argvv":["ls"]}"#,
        br#"{"op":"exec","argv":["ls"],"timeout":5}"#,
        br#"{"op":"ping","extra":1}"#,
        br#"{"op":"stat","path":"/","folow":false}"#,
        br#"{"op":"refresh","event":"fork","time_unix_ns":1,"entropy":"","hostname":"a","identity":{"name":"a","generation":0,"colour":"red"}}"#,
    ];
    for payload in cases {
        let e = Request::parse(payload).unwrap_err();
        assert_eq!(e.code(), ErrorCode::Invalid, "{e}");
        assert!(e.to_string().contains("unknown field"), "{e}");
    }
    // The same through the frame decoder.
    let e = decode_err(FrameType::Request, cases[0]);
    assert!(matches!(e, ProtocolError::BadPayload { .. }), "{e}");
    let e = decode_err(FrameType::Signal, br#"{"signal": 9, "to": "all"}"#);
    assert!(matches!(e, ProtocolError::BadPayload { .. }), "{e}");
}

#[test]
fn request_errors_say_what_is_wrong() {
    let e = Request::parse(br#"{"op":"format_disk"}"#).unwrap_err();
    assert_eq!(e.code(), ErrorCode::Unsupported);
    assert!(e.to_string().contains("format_disk"), "{e}");
    let e = Request::parse(br#"{"path":"/"}"#).unwrap_err();
    assert_eq!(e, RequestError::NoOp);
    let e = Request::parse(b"[1]").unwrap_err();
    assert!(matches!(e, RequestError::NotJson(_)));
    let e = Request::parse(br#"{"op":"exec","argv":["ls"],"shell":"ls"}"#).unwrap_err();
    assert!(e.to_string().contains("not both"), "{e}");
    let e = Request::parse(br#"{"op":"exec"}"#).unwrap_err();
    assert!(e.to_string().contains("argv or shell"), "{e}");
    let e = Request::parse(br#"{"op":"exec","argv":[]}"#).unwrap_err();
    assert!(e.to_string().contains("empty"), "{e}");
    let e = Request::parse(br#"{"op":"read_file","path":"relative"}"#).unwrap_err();
    assert!(e.to_string().contains("absolute"), "{e}");
    let e = Request::parse(br#"{"op":"write_file","path":"/a","mode":65536}"#).unwrap_err();
    assert!(e.to_string().contains("0o7777"), "{e}");
    let e = Request::parse(br#"{"op":"remove","path":"/","recursive":true}"#).unwrap_err();
    assert!(e.to_string().contains("refusing"), "{e}");
}

#[test]
fn request_defaults() {
    let r = Request::parse(br#"{"op":"write_file","path":"/a"}"#).unwrap();
    assert_eq!(
        r,
        Request::WriteFile(WriteFileRequest {
            path: "/a".into(),
            mode: 0o644,
            atomic: true,
            mkdirs: false
        })
    );
    let r = Request::parse(br#"{"op":"stat","path":"/a"}"#).unwrap();
    assert!(matches!(r, Request::Stat(StatRequest { follow: true, .. })));
    let r = Request::parse(br#"{"op":"exec","argv":["id"],"user":"1000"}"#).unwrap();
    match r {
        Request::Exec(e) => {
            assert_eq!(e.user, Some(User::Name("1000".into())));
            assert_eq!(e.stdin, StdinMode::None);
        }
        other => panic!("{other:?}"),
    }
    let r = Request::parse(br#"{"op":"exec","argv":["id"],"user":0,"stdin":"stream"}"#).unwrap();
    match r {
        Request::Exec(e) => {
            assert_eq!(e.user, Some(User::Uid(0)));
            assert_eq!(e.stdin, StdinMode::Stream);
        }
        other => panic!("{other:?}"),
    }
    assert!(Request::parse(br#"{"op":"exec","argv":["id"],"user":-1}"#).is_err());
    assert!(Request::parse(br#"{"op":"exec","argv":["id"],"stdin":"pipe"}"#).is_err());
}

#[test]
fn refresh_validation() {
    let good = RefreshRequest::new(RefreshEvent::Restore, 1, &[1u8; 32], "vm-1", identity());
    assert!(Request::Refresh(good.clone()).validate().is_ok());
    assert_eq!(good.entropy_bytes().unwrap(), vec![1u8; 32]);
    for hostname in ["", "-a", "a-", "a.b", "a_b", &"x".repeat(64)] {
        let mut r = good.clone();
        r.hostname = hostname.to_string();
        assert!(r.validate().is_err(), "{hostname:?} accepted");
    }
    for len in [0usize, 31, 513] {
        let r = RefreshRequest::new(RefreshEvent::Fork, 1, &vec![0u8; len], "a", identity());
        assert!(r.validate().is_err(), "{len} bytes of entropy accepted");
    }
    let mut r = good.clone();
    r.entropy = "not base64!".into();
    assert!(r.validate().unwrap_err().contains("entropy"));

    // The NIC's MAC: six hex bytes, unicast; absent means nothing to set.
    assert_eq!(good.mac_bytes().unwrap(), None);
    let with_mac = good.clone().with_mac([0x02, 0x6d, 0x66, 0, 0xab, 1]);
    assert_eq!(with_mac.mac.as_deref(), Some("02:6d:66:00:ab:01"));
    assert_eq!(
        with_mac.mac_bytes().unwrap(),
        Some([0x02, 0x6d, 0x66, 0, 0xab, 1])
    );
    assert!(Request::Refresh(with_mac).validate().is_ok());
    for mac in [
        "",
        "02:6d:66:00:ab",
        "02:6d:66:00:ab:01:02",
        "02-6d-66-00-ab-01",
        "2:6d:66:00:ab:01",
        "0g:6d:66:00:ab:01",
        "01:00:5e:00:00:01",
        "+2:6d:66:00:ab:01",
    ] {
        let mut r = good.clone();
        r.mac = Some(mac.into());
        assert!(r.validate().is_err(), "MAC {mac:?} accepted");
    }
    // Without a MAC the request is what an older VMM sends.
    assert!(!serde_json::to_string(&good).unwrap().contains("mac"));
}

#[test]
fn replies_accept_unknown_fields_from_newer_agents() {
    let m = Message::from_frame(Frame {
        kind: FrameType::Started,
        payload: br#"{"pid": 5, "cgroup": "/x"}"#.to_vec(),
    })
    .unwrap();
    assert_eq!(m, Message::Started(Started { pid: 5 }));
    let m = Message::from_frame(Frame {
        kind: FrameType::Error,
        payload: br#"{"error": "x", "code": "quota"}"#.to_vec(),
    })
    .unwrap();
    assert!(matches!(
        m,
        Message::Error(ErrorReply {
            code: ErrorCode::Other,
            ..
        })
    ));
}

#[test]
fn decoder_takes_bytes_in_any_pieces() {
    let mut stream = Vec::new();
    for msg in all_messages() {
        write_message(&mut stream, &msg).unwrap();
    }
    for piece in [1usize, 3, 7, 4096] {
        let mut d = FrameDecoder::new();
        let mut got = Vec::new();
        for chunk in stream.chunks(piece) {
            d.push(chunk);
            while let Some(f) = d.next_frame().unwrap() {
                got.push(Message::from_frame(f).unwrap());
            }
        }
        assert!(d.at_boundary());
        assert_eq!(got, all_messages(), "piece size {piece}");
    }
}

#[test]
fn decoder_refuses_bad_headers_before_the_payload() {
    let mut d = FrameDecoder::new();
    d.push(&u32::MAX.to_be_bytes());
    assert!(matches!(
        d.next_frame(),
        Err(ProtocolError::FrameTooLarge(_))
    ));
    let mut d = FrameDecoder::new();
    d.push(&0u32.to_be_bytes());
    assert!(matches!(d.next_frame(), Err(ProtocolError::EmptyFrame)));
    let mut d = FrameDecoder::new();
    d.push(&frame_bytes(100, &[0x42]));
    assert!(matches!(
        d.next_frame(),
        Err(ProtocolError::UnknownType(0x42))
    ));
    let mut d = FrameDecoder::new();
    d.push(&frame_bytes(100, &[0x04, 1, 2]));
    assert!(matches!(d.next_frame(), Ok(None)));
    assert!(!d.at_boundary());
}

#[test]
fn random_garbage_never_panics() {
    // A small deterministic generator: the point is many shapes of junk, reproducibly.
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for _ in 0..20_000 {
        let len = (next() % 24) as usize;
        let mut bytes: Vec<u8> = (0..len).map(|_| next() as u8).collect();
        if next() % 2 == 0 && bytes.len() >= 5 {
            // Make the length plausible so the payload decoders get exercised too.
            let l = (bytes.len() - 4) as u32;
            bytes[..4].copy_from_slice(&l.to_be_bytes());
            bytes[4] = (next() % 13) as u8;
        }
        let _ = read_message(&mut Cursor::new(bytes.clone()));
        let mut d = FrameDecoder::new();
        d.push(&bytes);
        if let Ok(Some(f)) = d.next_frame() {
            let _ = Message::from_frame(f);
        }
        let _ = Request::parse(&bytes);
    }
}
