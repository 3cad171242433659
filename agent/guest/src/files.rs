//! File ops: write_file, read_file, stat, list, remove, mkdir.

use std::fs::{self, File, OpenOptions, Permissions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use mayfly_agent_protocol::{
    read_message, write_frame, DirEntry, Empty, FileType, ListReply, ListRequest, Message,
    MkdirRequest, ProtocolError, ReadFileReply, ReadFileRequest, RemoveRequest, StatReply,
    StatRequest, WriteFileReply, WriteFileRequest, CHUNK_SIZE,
};

use crate::conn::Conn;
use crate::op::{send_ok, OpError, SessionError, SessionResult};

/// How much JSON one ENTRIES frame carries at most: well under MAX_FRAME, and a single
/// entry (a 255-byte name, escaped six times over at worst) always fits.
const ENTRIES_BUDGET: usize = 256 * 1024;

fn file_type(ft: fs::FileType) -> FileType {
    if ft.is_symlink() {
        FileType::Symlink
    } else if ft.is_dir() {
        FileType::Dir
    } else if ft.is_file() {
        FileType::File
    } else {
        FileType::Other
    }
}

fn mtime_ms(meta: &fs::Metadata) -> i64 {
    meta.mtime() * 1000 + meta.mtime_nsec() / 1_000_000
}

/// Removes a temporary file unless disarmed: a failed or abandoned atomic write leaves
/// nothing behind.
struct TempFile(Option<PathBuf>);

impl Drop for TempFile {
    fn drop(&mut self) {
        if let Some(path) = self.0.take() {
            let _ = fs::remove_file(path);
        }
    }
}

pub fn write_file(conn: &mut Conn, req: &WriteFileRequest) -> SessionResult {
    let path = Path::new(&req.path);
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(OpError::invalid(format!("{} names no file", req.path)).into());
    };
    if req.mkdirs {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(dir)
            .map_err(|e| OpError::io(format!("cannot create {}", dir.display()), &e))?;
    }
    let (mut file, mut temp) = if req.atomic {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let temp = dir.join(format!(
            ".{}.mayfly-{}-{}.tmp",
            name.to_string_lossy(),
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&temp)
            .map_err(|e| OpError::io(format!("cannot create a file in {}", dir.display()), &e))?;
        (file, TempFile(Some(temp)))
    } else {
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(req.mode)
            .open(path)
            .map_err(|e| OpError::io(format!("cannot create {}", req.path), &e))?;
        (file, TempFile(None))
    };

    let bytes = receive_data(conn, &mut file, &req.path)?;
    let fail = |what: &str| {
        let path = req.path.clone();
        let what = what.to_owned();
        move |e: io::Error| SessionError::Op(OpError::io(format!("{what} {path}"), &e))
    };
    // Exactly the requested bits: the open's mode was masked by the umask.
    file.set_permissions(Permissions::from_mode(req.mode))
        .map_err(fail("cannot set the mode of"))?;
    if let Some(temp_path) = temp.0.clone() {
        file.sync_all().map_err(fail("cannot sync"))?;
        fs::rename(&temp_path, path).map_err(fail("cannot rename a temporary file over"))?;
        // The temporary name is gone: nothing to clean up any more.
        temp.0 = None;
        // Make the rename itself durable; failing that is not worth failing the write.
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
    }
    drop(file);
    send_ok(conn, &WriteFileReply { bytes })
}

/// Copies DATA frames into `file` until the empty one.
fn receive_data(conn: &mut Conn, file: &mut File, path: &str) -> Result<u64, SessionError> {
    let mut total = 0u64;
    loop {
        match read_message(conn)? {
            Some(Message::Data(bytes)) if bytes.is_empty() => return Ok(total),
            Some(Message::Data(bytes)) => {
                file.write_all(&bytes)
                    .map_err(|e| OpError::io(format!("cannot write {path}"), &e))?;
                total += bytes.len() as u64;
            }
            Some(other) => {
                return Err(ProtocolError::Unexpected {
                    expected: "DATA during write_file",
                    got: other.frame_type(),
                }
                .into())
            }
            None => return Err(SessionError::Gone(io::ErrorKind::UnexpectedEof.into())),
        }
    }
}

pub fn read_file(conn: &mut Conn, req: &ReadFileRequest) -> SessionResult {
    let mut file =
        File::open(&req.path).map_err(|e| OpError::io(format!("cannot open {}", req.path), &e))?;
    let meta = file
        .metadata()
        .map_err(|e| OpError::io(format!("cannot stat {}", req.path), &e))?;
    if meta.is_dir() {
        return Err(OpError::invalid(format!("{} is a directory (use list)", req.path)).into());
    }
    send_ok(
        conn,
        &ReadFileReply {
            size: meta.len(),
            mode: meta.mode() & 0o7777,
        },
    )?;
    let mut buf = vec![0u8; CHUNK_SIZE];
    loop {
        match file.read(&mut buf) {
            Ok(n) => {
                write_frame(conn, mayfly_agent_protocol::FrameType::Data, &buf[..n])?;
                if n == 0 {
                    return Ok(());
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(OpError::io(format!("cannot read {}", req.path), &e).into()),
        }
    }
}

pub fn stat(conn: &mut Conn, req: &StatRequest) -> SessionResult {
    let meta = if req.follow {
        fs::metadata(&req.path)
    } else {
        fs::symlink_metadata(&req.path)
    }
    .map_err(|e| OpError::io(format!("cannot stat {}", req.path), &e))?;
    send_ok(
        conn,
        &StatReply {
            file_type: file_type(meta.file_type()),
            size: meta.len(),
            mode: meta.mode() & 0o7777,
            mtime_ms: mtime_ms(&meta),
            uid: meta.uid(),
            gid: meta.gid(),
        },
    )
}

/// Streams the directory in readdir order, in batches, so a huge directory costs one batch
/// of memory.
pub fn list(conn: &mut Conn, req: &ListRequest) -> SessionResult {
    let dir = fs::read_dir(&req.path)
        .map_err(|e| OpError::io(format!("cannot list {}", req.path), &e))?;
    let mut batch: Vec<u8> = Vec::new();
    let mut count = 0u64;
    for entry in dir {
        // Entries that vanish while we look are simply not listed.
        let Ok(entry) = entry else { continue };
        let Ok(meta) = entry.metadata() else { continue };
        let item = DirEntry {
            name: entry.file_name().to_string_lossy().into_owned(),
            file_type: file_type(meta.file_type()),
            size: meta.len(),
            mode: meta.mode() & 0o7777,
            mtime_ms: mtime_ms(&meta),
        };
        let json = serde_json::to_vec(&item)
            .map_err(|e| OpError::invalid(format!("cannot encode an entry: {e}")))?;
        if !batch.is_empty() && batch.len() + json.len() + 2 > ENTRIES_BUDGET {
            flush_entries(conn, &mut batch)?;
        }
        batch.push(if batch.is_empty() { b'[' } else { b',' });
        batch.extend_from_slice(&json);
        count += 1;
    }
    flush_entries(conn, &mut batch)?;
    send_ok(conn, &ListReply { count })
}

fn flush_entries(conn: &mut Conn, batch: &mut Vec<u8>) -> SessionResult {
    if batch.is_empty() {
        return Ok(());
    }
    batch.push(b']');
    write_frame(conn, mayfly_agent_protocol::FrameType::Entries, batch)?;
    batch.clear();
    Ok(())
}

pub fn remove(conn: &mut Conn, req: &RemoveRequest) -> SessionResult {
    let meta = fs::symlink_metadata(&req.path)
        .map_err(|e| OpError::io(format!("cannot remove {}", req.path), &e))?;
    let result = if meta.is_dir() {
        if req.recursive {
            fs::remove_dir_all(&req.path)
        } else {
            fs::remove_dir(&req.path)
        }
    } else {
        fs::remove_file(&req.path)
    };
    result.map_err(|e| {
        let hint = if e.raw_os_error() == Some(libc::ENOTEMPTY) {
            " (a directory with contents needs recursive: true)"
        } else {
            ""
        };
        OpError::io(format!("cannot remove {}{hint}", req.path), &e)
    })?;
    send_ok(conn, &Empty {})
}

pub fn mkdir(conn: &mut Conn, req: &MkdirRequest) -> SessionResult {
    let path = Path::new(&req.path);
    let existed = path.is_dir();
    let mut builder = fs::DirBuilder::new();
    builder.recursive(req.parents).mode(req.mode);
    builder
        .create(path)
        .map_err(|e| OpError::io(format!("cannot create {}", req.path), &e))?;
    if !existed {
        // Exactly the requested bits: mkdir's mode was masked by the umask.
        fs::set_permissions(path, Permissions::from_mode(req.mode))
            .map_err(|e| OpError::io(format!("cannot set the mode of {}", req.path), &e))?;
    }
    send_ok(conn, &Empty {})
}
