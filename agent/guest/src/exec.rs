//! The exec op: start a program, stream its output, feed its stdin, deliver signals,
//! enforce its timeout, report how it ended.
//!
//! One thread runs a poll loop over the connection, the program's three pipes and its
//! waiter. Backpressure is exact: a pipe is read only when the previous chunk from it has
//! been fully written to the connection, so the agent holds at most one chunk per stream
//! however fast the program writes and however slowly the host reads.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use mayfly_agent_protocol::{
    ErrorCode, ExecRequest, FrameDecoder, FrameType, Message, ProtocolError, Started, StdinMode,
    User, CHUNK_SIZE, MAX_FRAME,
};

use crate::conn::Conn;
use crate::op::{send, OpError, SessionError, SessionResult};
use crate::process::{
    base_env, configure, exit_record, poll, poll_timeout, pollfd, spawn_failure, Switch,
    WaitResult, Waiter, EXIT_GRACE, KILL_GRACE,
};
use crate::sys::{self, bytes_readable, kill_group, set_nonblocking};
use crate::users;

/// How much stdin the agent holds for a program that is not reading it. Past this it stops
/// reading the connection (so SIGNAL frames behind the stdin wait too; the timeout does
/// not).
const STDIN_AHEAD: usize = 256 * 1024;

/// Where passwd and group live; a constant so the lookup code stays testable with others.
const ETC: &str = "/etc";

pub fn run(conn: &mut Conn, req: &ExecRequest) -> SessionResult {
    let etc = Path::new(ETC);
    let account = match &req.user {
        None => users::current(etc),
        Some(User::Name(name)) => {
            users::lookup(etc, name).map_err(|e| OpError::new(ErrorCode::NotFound, e))?
        }
        Some(User::Uid(uid)) => users::by_uid(etc, *uid),
    };
    let mut env = if req.clear_env {
        Default::default()
    } else {
        base_env(&account)
    };
    env.extend(req.env.iter().map(|(k, v)| (k.clone(), v.clone())));
    let cwd = req.cwd.as_deref().unwrap_or("/");
    match std::fs::metadata(cwd) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return Err(OpError::invalid(format!("cwd {cwd} is not a directory")).into()),
        Err(e) => return Err(OpError::io(format!("cwd {cwd}"), &e).into()),
    }
    let (program, args): (&str, Vec<&str>) = match (&req.argv, &req.shell) {
        (Some(argv), _) if !argv.is_empty() => (
            argv[0].as_str(),
            argv[1..].iter().map(String::as_str).collect(),
        ),
        (_, Some(shell)) => ("/bin/sh", vec!["-c", shell.as_str()]),
        _ => return Err(OpError::invalid("give argv or shell").into()),
    };

    let mut cmd = Command::new(program);
    cmd.args(&args)
        .env_clear()
        .envs(&env)
        .current_dir(cwd)
        .stdin(match req.stdin {
            StdinMode::None => Stdio::null(),
            StdinMode::Stream => Stdio::piped(),
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    configure(&mut cmd, Switch::to(&account));

    let started = Instant::now();
    let mut child = match cmd.spawn() {
        Ok(child) => child,
        Err(e) => {
            // Not started: no STARTED, an EXIT saying why, as a shell would have it.
            let (code, reason) = spawn_failure(program, &e);
            let mut rec = exit_record(None, started.elapsed(), false);
            rec.exit_code = Some(code);
            rec.error = Some(reason);
            return send(conn, &Message::Exit(rec));
        }
    };
    let pid = child.id();
    let stdin = child.stdin.take().map(OwnedFd::from);
    let stdout = child.stdout.take().map(OwnedFd::from);
    let stderr = child.stderr.take().map(OwnedFd::from);
    let waiter = Waiter::spawn(pid).map_err(|e| OpError::io("cannot start a waiter thread", &e))?;
    if let Err(e) = send(conn, &Message::Started(Started { pid })) {
        kill_group(pid, libc::SIGKILL);
        waiter.wait();
        return Err(e);
    }

    let mut pump = Pump::new(conn, pid, stdin, [stdout, stderr])?;
    let deadline = req.timeout_ms.map(|ms| started + Duration::from_millis(ms));
    match pump.run(&waiter, deadline) {
        Ok((result, timed_out)) => {
            let wall = started.elapsed();
            conn.set_nonblocking(false).map_err(SessionError::Gone)?;
            send(conn, &Message::Exit(exit_record(result, wall, timed_out)))
        }
        Err(end) => {
            // The host is gone or broke the protocol: nobody will see this program's
            // output, so nothing of it may stay behind.
            kill_group(pid, libc::SIGKILL);
            waiter.wait();
            Err(end)
        }
    }
}

/// One of the program's output pipes.
struct Output {
    fd: Option<OwnedFd>,
    kind: FrameType,
    /// A frame from this pipe is waiting to be written to the connection.
    queued: bool,
}

struct Pump<'a> {
    conn: &'a mut Conn,
    pid: u32,
    decoder: FrameDecoder,
    /// Encoded frames for the connection, each tagged with the output it came from.
    outq: VecDeque<(usize, Vec<u8>)>,
    out_pos: usize,
    outputs: [Output; 2],
    stdin: Option<OwnedFd>,
    stdin_buf: VecDeque<Vec<u8>>,
    stdin_pos: usize,
    stdin_buffered: usize,
    /// The host sent the empty STDIN frame.
    stdin_eof: bool,
    readbuf: Vec<u8>,
}

impl<'a> Pump<'a> {
    fn new(
        conn: &'a mut Conn,
        pid: u32,
        stdin: Option<OwnedFd>,
        outs: [Option<OwnedFd>; 2],
    ) -> Result<Pump<'a>, SessionError> {
        let nonblocking = |fd: &Option<OwnedFd>| match fd {
            Some(fd) => set_nonblocking(fd.as_raw_fd(), true),
            None => Ok(()),
        };
        let setup = || -> io::Result<()> {
            conn.set_nonblocking(true)?;
            nonblocking(&stdin)?;
            outs.iter().try_for_each(nonblocking)
        };
        if let Err(e) = setup() {
            kill_group(pid, libc::SIGKILL);
            return Err(OpError::io("cannot set up the program's pipes", &e).into());
        }
        let [stdout, stderr] = outs;
        Ok(Pump {
            conn,
            pid,
            decoder: FrameDecoder::new(),
            outq: VecDeque::new(),
            out_pos: 0,
            outputs: [
                Output {
                    fd: stdout,
                    kind: FrameType::Stdout,
                    queued: false,
                },
                Output {
                    fd: stderr,
                    kind: FrameType::Stderr,
                    queued: false,
                },
            ],
            stdin,
            stdin_buf: VecDeque::new(),
            stdin_pos: 0,
            stdin_buffered: 0,
            stdin_eof: false,
            readbuf: vec![0u8; CHUNK_SIZE],
        })
    }

    /// Runs until the program has exited and its output is delivered. Returns the wait
    /// result and whether the timeout killed it; an error when the connection failed or
    /// the host broke the protocol (the caller kills the program).
    fn run(
        &mut self,
        waiter: &Waiter,
        deadline: Option<Instant>,
    ) -> Result<(Option<WaitResult>, bool), SessionError> {
        let mut exited: Option<Option<WaitResult>> = None;
        let mut timed_out = false;
        let mut kill_at: Option<Instant> = None;
        let mut grace_end: Option<Instant> = None;
        loop {
            let now = Instant::now();
            if exited.is_none() {
                if !timed_out && deadline.is_some_and(|d| now >= d) {
                    timed_out = true;
                    kill_group(self.pid, libc::SIGTERM);
                    kill_at = Some(now + KILL_GRACE);
                }
                if kill_at.is_some_and(|k| now >= k) {
                    kill_group(self.pid, libc::SIGKILL);
                    kill_at = None;
                }
            } else {
                if grace_end.is_some_and(|g| now >= g) {
                    self.close_idle_outputs();
                }
                if self.outputs.iter().all(|o| o.fd.is_none()) && self.outq.is_empty() {
                    return Ok((exited.flatten(), timed_out));
                }
            }

            // Indices into `fds`: 0 the connection, 1-2 the outputs, then stdin and waiter.
            let mut fds = [pollfd(-1, 0); 5];
            let mut sock_events = 0;
            if self.stdin_buffered < STDIN_AHEAD {
                sock_events |= libc::POLLIN;
            }
            if !self.outq.is_empty() {
                sock_events |= libc::POLLOUT;
            }
            // Polled even with no events: POLLHUP/POLLERR say the host went away.
            fds[0] = pollfd(self.conn.raw_fd(), sock_events);
            for (i, out) in self.outputs.iter().enumerate() {
                if let (Some(fd), false) = (&out.fd, out.queued) {
                    fds[1 + i] = pollfd(fd.as_raw_fd(), libc::POLLIN);
                }
            }
            if let (Some(fd), false) = (&self.stdin, self.stdin_buf.is_empty()) {
                fds[3] = pollfd(fd.as_raw_fd(), libc::POLLOUT);
            }
            if exited.is_none() {
                fds[4] = pollfd(waiter.fd(), libc::POLLIN);
            }
            let timeout = if exited.is_none() {
                poll_timeout(&[deadline.filter(|_| !timed_out), kill_at])
            } else {
                poll_timeout(&[grace_end])
            };
            poll(&mut fds, timeout).map_err(|e| OpError::io("poll", &e))?;

            let sock = fds[0].revents;
            if sock & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0 {
                return Err(SessionError::Gone(io::ErrorKind::ConnectionReset.into()));
            }
            if sock & libc::POLLIN != 0 {
                self.read_connection()?;
            }
            if sock & libc::POLLOUT != 0 {
                self.write_connection()?;
            }
            for i in 0..2 {
                if fds[1 + i].fd >= 0 && fds[1 + i].revents != 0 {
                    self.read_output(i);
                }
            }
            if fds[3].fd >= 0 && fds[3].revents != 0 {
                self.write_stdin();
            }
            if fds[4].fd >= 0 && fds[4].revents != 0 {
                if let Some(result) = waiter.try_result() {
                    exited = Some(result);
                    grace_end = Some(Instant::now() + EXIT_GRACE);
                    // Nobody reads stdin for the program any more.
                    self.stdin = None;
                    self.stdin_buf.clear();
                    self.stdin_buffered = 0;
                    if timed_out {
                        // The timeout kills everything in the group, including what
                        // outlived the program or ignored SIGTERM.
                        kill_group(self.pid, libc::SIGKILL);
                    }
                }
            }
        }
    }

    fn read_connection(&mut self) -> Result<(), SessionError> {
        match self.conn.read(&mut self.readbuf) {
            Ok(0) => {
                // The host must keep the connection open until EXIT.
                Err(SessionError::Gone(io::ErrorKind::UnexpectedEof.into()))
            }
            Ok(n) => {
                self.decoder.push(&self.readbuf[..n]);
                while let Some(frame) = self.decoder.next_frame()? {
                    self.handle_frame(Message::from_frame(frame)?)?;
                }
                Ok(())
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) =>
            {
                Ok(())
            }
            Err(e) => Err(SessionError::Gone(e)),
        }
    }

    fn handle_frame(&mut self, msg: Message) -> Result<(), SessionError> {
        match msg {
            Message::Stdin(data) if data.is_empty() => {
                self.stdin_eof = true;
                if self.stdin_buf.is_empty() {
                    self.stdin = None;
                }
            }
            Message::Stdin(data) => {
                // Without a stdin pipe (stdin "none", or the program closed it), or after
                // the end of input, stdin bytes have nowhere to go.
                if self.stdin.is_some() && !self.stdin_eof {
                    self.stdin_buffered += data.len();
                    self.stdin_buf.push_back(data);
                }
            }
            Message::Signal(s) => {
                if (1..=64).contains(&s.signal) {
                    kill_group(self.pid, s.signal);
                } else {
                    log!("ignoring SIGNAL {}: not a signal number", s.signal);
                }
            }
            other => {
                return Err(ProtocolError::Unexpected {
                    expected: "STDIN or SIGNAL while a program runs",
                    got: other.frame_type(),
                }
                .into())
            }
        }
        Ok(())
    }

    fn write_connection(&mut self) -> Result<(), SessionError> {
        while let Some((source, frame)) = self.outq.front() {
            match self.conn.write(&frame[self.out_pos..]) {
                Ok(n) => {
                    self.out_pos += n;
                    if self.out_pos == frame.len() {
                        self.outputs[*source].queued = false;
                        self.outq.pop_front();
                        self.out_pos = 0;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(SessionError::Gone(e)),
            }
        }
        Ok(())
    }

    /// Reads one chunk from output `i` into a frame, in place (header first, then data).
    fn read_output(&mut self, i: usize) {
        let out = &mut self.outputs[i];
        let Some(fd) = &out.fd else { return };
        let mut frame = vec![0u8; 5 + CHUNK_SIZE];
        match sys::read(fd, &mut frame[5..]) {
            Ok(0) => out.fd = None,
            Ok(n) => {
                debug_assert!(n < MAX_FRAME);
                frame.truncate(5 + n);
                // Below MAX_FRAME, which fits the u32 length field.
                frame[..4].copy_from_slice(
                    &u32::try_from(n + 1)
                        .expect("a frame within MAX_FRAME")
                        .to_be_bytes(),
                );
                frame[4] = out.kind.as_byte();
                out.queued = true;
                self.outq.push_back((i, frame));
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) => {}
            Err(_) => out.fd = None,
        }
    }

    fn write_stdin(&mut self) {
        let Some(fd) = &self.stdin else { return };
        while let Some(chunk) = self.stdin_buf.front() {
            match sys::write(fd, &chunk[self.stdin_pos..]) {
                Ok(n) => {
                    self.stdin_pos += n;
                    self.stdin_buffered -= n;
                    if self.stdin_pos == chunk.len() {
                        self.stdin_buf.pop_front();
                        self.stdin_pos = 0;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => {
                    // The program closed its stdin (EPIPE): the rest is dropped.
                    self.stdin = None;
                    self.stdin_buf.clear();
                    self.stdin_buffered = 0;
                    self.stdin_pos = 0;
                    return;
                }
            }
        }
        if self.stdin_eof {
            self.stdin = None;
        }
    }

    /// After the exit grace: stop reading pipes that processes left behind keep open,
    /// once nothing is waiting in them.
    fn close_idle_outputs(&mut self) {
        for out in &mut self.outputs {
            if let Some(fd) = &out.fd {
                if !out.queued && bytes_readable(fd.as_raw_fd()).unwrap_or(0) == 0 {
                    out.fd = None;
                }
            }
        }
    }
}
