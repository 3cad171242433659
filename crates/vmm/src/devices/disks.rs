//! A VM's disks, host side: what `--disk` and `--rootfs` ask for, the directory where a VM
//! keeps its own layers, the base image's identity, and what snapshots, restores and forks do
//! with layers. The layered disk itself (reads, writes, freeze, compaction) is
//! `mayfly_devices::disk`; the guest's device is `mayfly_devices::virtio::block`.
//!
//! - A writable disk is a read-only **base** (never opened for writing) under layers; the top
//!   layer, the only one written, lives in the VM's **disk directory** (`--disk-dir`, by
//!   default `<api-sock>.disks`), next to `<serial>.chain.json`, the manifest that says which
//!   files the disk is made of. A VMM killed with `kill -9` and started again with the same
//!   `--disk` and `--disk-dir` carries on on the same layers: what the guest had synced is there.
//! - A **snapshot** freezes each writable disk's top (metadata only) and stacks a new empty top
//!   on it; the snapshot directory gets hard links to every layer of the chain under `disks/`
//!   (the layers are frozen: never written again, so sharing their inodes is safe), and its
//!   state names them relative to itself: a snapshot directory is self-contained but for the
//!   base, which it names by content hash. Nothing is copied, whatever the layers hold.
//! - A **restore** stacks a new top layer on the snapshot's frozen chain, in its own disk
//!   directory; a **fork** freezes the parent's disks the same way and each clone stacks its
//!   own top on the parent's frozen chain (in `<clone>.disks` beside its socket).
//! - The base's identity is the SHA-256 of its content, computed once per version of the file:
//!   it is cached under `$MAYFLY_CACHE/base-ids` by device, inode, size and change time (any
//!   write to the file changes its ctime, which nobody can set back), so a restore checks it
//!   with a `stat` rather than by reading gigabytes.

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Component, Path, PathBuf};
use std::str::FromStr;

use mayfly_devices::disk::{create_layer, Chain, Disk, DiskError, LayerInfo};
use mayfly_devices::virtio::block::BlockState;

/// Where a snapshot directory keeps its disks' layers.
pub use mayfly_snapshot::DISKS_DIR as SNAPSHOT_DISKS;
/// What `--rootfs` adds to the kernel command line: the first disk is the root file system,
/// mounted read-write (the VMM keeps the base read-only under the VM's own layer), and busybox
/// init runs the same inittab as the initramfs guest.
pub const ROOT_CMDLINE: &str = "root=/dev/vda rw rootfstype=ext4 rootwait init=/sbin/init";
/// A manifest is a few paths: anything larger is not one.
const MAX_MANIFEST_BYTES: u64 = 1 << 20;
/// The most disks a VM may have (virtio-blk names them vda..vdz).
pub const MAX_DISKS: usize = 26;

#[derive(Debug, thiserror::Error)]
pub enum DiskSetupError {
    #[error("--disk {0:?}: expected PATH or PATH,ro (PATH must not contain a comma)")]
    BadSpec(String),
    #[error("more than {MAX_DISKS} disks: mayfly names them vda..vdz")]
    TooManyDisks,
    #[error("a writable disk needs a directory for the VM's own layer: give --disk-dir DIR (or --api-sock, which puts it at <api-sock>.disks), or attach the disk read-only (PATH,ro)")]
    NoDiskDir,
    #[error("the disk directory {path} {problem}")]
    DiskDir { path: PathBuf, problem: String },
    #[error("the Debian image is not built (looked for {0}): run rootfs/build.sh debian (scripts/setup.sh does), or give --rootfs PATH")]
    NoDebianImage(PathBuf),
    #[error("cannot {what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    // What the file now hashes to is not said: the path may come from a snapshot the caller
    // did not write, and its digest would tell them about a file they may not read.
    #[error("the base image {path} is not the one the disk was made on (recorded: {expected}): use the same image, or start afresh without the old layers")]
    BaseChanged { path: PathBuf, expected: String },
    #[error("the disk manifest {path} was made for the base {recorded}, not {given}: give the same --disk, or another --disk-dir")]
    OtherBase {
        path: PathBuf,
        recorded: PathBuf,
        given: PathBuf,
    },
    #[error("the disk manifest {path} cannot be used: {reason}")]
    Manifest { path: PathBuf, reason: String },
    #[error("the snapshot names the disk layer {0:?}, which is not a file of its disks/ directory: the snapshot is damaged or was edited")]
    BadLayerName(String),
    #[error("the snapshot's disks are in its directory, but this restore has none (a fork's state names its layers by full path)")]
    NoSnapshotDir,
    #[error("the snapshot names the disk layer {layer}, which cannot be opened inside its disks/ directory ({source}): the snapshot is damaged, or names a file outside itself")]
    LayerUnreadable {
        layer: PathBuf,
        source: std::io::Error,
    },
    #[error("the snapshot {snapshot} and the disk layer {layer} are on different file systems: layers are hard-linked into snapshots, never copied; put the snapshot on the same file system as the VM's --disk-dir")]
    CrossDevice { snapshot: PathBuf, layer: PathBuf },
    #[error("the snapshot names the disk layer {layer}, outside {within}, where the layers of this restore must be (a snapshot written by a VMM the restorer does not trust)")]
    LayerOutside { layer: PathBuf, within: PathBuf },
    #[error(transparent)]
    Disk(#[from] DiskError),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> DiskSetupError {
    move |source| DiskSetupError::Io {
        what: what.into(),
        source,
    }
}

/// One `--disk`: an image and whether the guest may write (to its own layer: the image itself
/// is never written).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskSpec {
    pub path: PathBuf,
    pub read_only: bool,
}

impl FromStr for DiskSpec {
    type Err = DiskSetupError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut parts = s.split(',');
        let path = parts.next().unwrap_or_default();
        if path.is_empty() {
            return Err(DiskSetupError::BadSpec(s.to_string()));
        }
        let mut read_only = false;
        for option in parts {
            match option {
                "ro" => read_only = true,
                "rw" => read_only = false,
                _ => return Err(DiskSetupError::BadSpec(s.to_string())),
            }
        }
        Ok(Self {
            path: PathBuf::from(path),
            read_only,
        })
    }
}

/// The disk's name in the guest (`vda`, `vdb`, ...), also its serial number and the stem of its
/// files in the disk directory.
pub fn serial(index: usize) -> Result<String, DiskSetupError> {
    let letter = u8::try_from(index)
        .ok()
        .filter(|&i| usize::from(i) < MAX_DISKS)
        .ok_or(DiskSetupError::TooManyDisks)?;
    Ok(format!("vd{}", char::from(b'a' + letter)))
}

/// What `--rootfs` names: `debian` (the image `rootfs/build.sh debian` built) or a path.
pub fn rootfs_image(name: &str) -> Result<PathBuf, DiskSetupError> {
    if name != "debian" {
        return Ok(PathBuf::from(name));
    }
    let path = crate::settings::get()
        .cache_dir
        .clone()
        .unwrap_or_else(|| PathBuf::from("~/.cache/mayfly"))
        .join("rootfs/debian.current/root.ext4");
    match std::fs::metadata(&path) {
        Ok(meta) if meta.is_file() => Ok(path),
        _ => Err(DiskSetupError::NoDebianImage(path)),
    }
}

/// Open `path` read-only as a regular file, without waiting on a FIFO or running a device's
/// open routine.
fn open_regular(path: &Path) -> Result<File, DiskError> {
    let file = File::options()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|source| DiskError::Open {
            path: path.to_path_buf(),
            source,
        })?;
    match file.metadata() {
        Ok(meta) if meta.is_file() => Ok(file),
        Ok(_) => Err(DiskError::NotAFile {
            path: path.to_path_buf(),
        }),
        Err(source) => Err(DiskError::Open {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// The base image's identity, `sha256:<hex>` of its content (cached, see the module comment).
pub fn base_identity(path: &Path) -> Result<String, DiskSetupError> {
    let mut file = open_regular(path)?;
    let before = file
        .metadata()
        .map_err(io(format!("stat {}", path.display())))?;
    let key = |m: &std::fs::Metadata| {
        format!(
            "{:x}-{:x}-{}-{}.{:09}",
            m.dev(),
            m.ino(),
            m.size(),
            m.ctime(),
            m.ctime_nsec()
        )
    };
    let cached = crate::settings::get()
        .cache_dir
        .as_ref()
        .map(|dir| dir.join("base-ids").join(key(&before)));
    if let Some(cached) = &cached {
        if let Ok(text) = std::fs::read_to_string(cached) {
            let text = text.trim();
            if is_identity(text) {
                return Ok(text.to_string());
            }
        }
    }
    use sha2::Digest;
    let mut hasher = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file
            .read(&mut buf)
            .map_err(io(format!("read {}", path.display())))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    let identity = format!("sha256:{}", hex(&hasher.finalize()));
    // Cached only if the file did not change while it was read.
    let after = file
        .metadata()
        .map_err(io(format!("stat {}", path.display())))?;
    if let Some(cached) = cached.filter(|_| key(&after) == key(&before)) {
        let _ = write_atomically(&cached, identity.as_bytes());
    }
    Ok(identity)
}

fn is_identity(s: &str) -> bool {
    s.strip_prefix("sha256:")
        .is_some_and(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Write `bytes` to `path` atomically (see `mayfly_sys::atomic`), creating the parent
/// directory if need be.
fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    std::fs::create_dir_all(path.parent().unwrap_or(Path::new(".")))?;
    mayfly_sys::atomic::write(path, bytes)
}

/// Make (or reuse) the VM's disk directory: a real directory, not a symlink to one.
pub fn prepare_dir(path: &Path) -> Result<PathBuf, DiskSetupError> {
    let path = std::path::absolute(path).map_err(io(format!("resolve {}", path.display())))?;
    match std::fs::DirBuilder::new().mode(0o700).create(&path) {
        Ok(()) => return Ok(path),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => {
            return Err(DiskSetupError::DiskDir {
                path,
                problem: format!("cannot be created: {e}"),
            })
        }
    }
    match std::fs::symlink_metadata(&path) {
        Ok(meta) if meta.is_dir() => Ok(path),
        Ok(_) => Err(DiskSetupError::DiskDir {
            path,
            problem: "exists and is not a directory (symlinks are not followed)".into(),
        }),
        Err(e) => Err(DiskSetupError::DiskDir {
            path,
            problem: e.to_string(),
        }),
    }
}

/// A new layer's path in `dir`: `<serial>-<random>.layer`.
fn new_layer_path(dir: &Path, serial: &str) -> Result<PathBuf, DiskSetupError> {
    let mut id = [0u8; 8];
    crate::identity::host_random(&mut id).map_err(io("read the host's random numbers"))?;
    Ok(dir.join(format!("{serial}-{}.layer", hex(&id))))
}

fn manifest_path(dir: &Path, serial: &str) -> PathBuf {
    dir.join(format!("{serial}.chain.json"))
}

/// Record which files the disk is made of now (after a boot, freeze or restore).
pub fn write_manifest(dir: &Path, serial: &str, chain: &Chain) -> Result<(), DiskSetupError> {
    let path = manifest_path(dir, serial);
    let json = serde_json::to_vec_pretty(chain).map_err(|e| DiskSetupError::Manifest {
        path: path.clone(),
        reason: e.to_string(),
    })?;
    write_atomically(&path, &json).map_err(io(format!("write {}", path.display())))
}

fn read_manifest(path: &Path) -> Result<Option<Chain>, DiskSetupError> {
    let file = match File::options()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
    {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(DiskSetupError::Manifest {
                path: path.to_path_buf(),
                reason: e.to_string(),
            })
        }
    };
    let bad = |reason: String| DiskSetupError::Manifest {
        path: path.to_path_buf(),
        reason,
    };
    let meta = file.metadata().map_err(|e| bad(e.to_string()))?;
    if !meta.is_file() || meta.len() > MAX_MANIFEST_BYTES {
        return Err(bad(format!(
            "not a regular file of at most {MAX_MANIFEST_BYTES} bytes"
        )));
    }
    let mut text = Vec::new();
    file.take(MAX_MANIFEST_BYTES)
        .read_to_end(&mut text)
        .map_err(|e| bad(e.to_string()))?;
    serde_json::from_slice(&text)
        .map(Some)
        .map_err(|e| bad(format!("{e}: remove it to start the disk afresh")))
}

/// The disk `spec` asks for at boot. Read-only: the image alone. Writable: the layers the disk
/// directory's manifest names (a VMM started again after it died carries on on them), else a
/// new layer on the image.
pub fn open_for_boot(
    spec: &DiskSpec,
    serial: &str,
    dir: Option<&Path>,
) -> Result<Disk, DiskSetupError> {
    let base =
        std::path::absolute(&spec.path).map_err(io(format!("resolve {}", spec.path.display())))?;
    let identity = base_identity(&base)?;
    if spec.read_only {
        let chain = Chain {
            base,
            base_identity: identity,
            layers: Vec::new(),
        };
        return Ok(Disk::open(&chain, true)?);
    }
    let dir = prepare_dir(dir.ok_or(DiskSetupError::NoDiskDir)?)?;
    let manifest = manifest_path(&dir, serial);
    if let Some(chain) = read_manifest(&manifest)? {
        if chain.base != base {
            return Err(DiskSetupError::OtherBase {
                path: manifest,
                recorded: chain.base,
                given: base,
            });
        }
        if chain.base_identity != identity {
            return Err(DiskSetupError::BaseChanged {
                path: base,
                expected: chain.base_identity,
            });
        }
        return Ok(Disk::open(&chain, false)?);
    }
    let top = new_layer_path(&dir, serial)?;
    let disk = Disk::create(&base, &identity, &top, None)?;
    write_manifest(&dir, serial, &disk.chain())?;
    Ok(disk)
}

/// A layer name from a snapshot's state: `disks/<file>`, a plain file name.
fn snapshot_layer(snapshot: &Path, name: &Path) -> Result<PathBuf, DiskSetupError> {
    let bad = || DiskSetupError::BadLayerName(name.display().to_string());
    let mut parts = name.components();
    match (parts.next(), parts.next(), parts.next()) {
        (Some(Component::Normal(d)), Some(Component::Normal(file)), None)
            if d == SNAPSHOT_DISKS && !file.is_empty() =>
        {
            Ok(snapshot.join(SNAPSHOT_DISKS).join(file))
        }
        _ => Err(bad()),
    }
}

/// The disk of a restored block device: the snapshot's frozen chain (relative to
/// `snapshot_dir` for a snapshot directory, full paths for a fork's state) with the base
/// checked against the identity the snapshot recorded, and, if writable, a new top layer of
/// the VM's own in `dir`.
///
/// `layers_within`: every layer named by full path must lie in this directory (after
/// symbolic links are resolved). The sandbox manager restores, as root, snapshots a jailed
/// VMM wrote: such a snapshot must not name another sandbox's layers, or any other file.
pub fn open_for_restore(
    state: &BlockState,
    snapshot_dir: Option<&Path>,
    dir: Option<&Path>,
    layers_within: Option<&Path>,
    layers_moved: Option<&(PathBuf, PathBuf)>,
) -> Result<Disk, DiskSetupError> {
    let mut chain = state.chain.clone();
    // Full paths from here on: a fork of this VM hands them to clones, the manifest keeps
    // them, and neither may depend on the directory this VMM was started in.
    let snapshot_dir = snapshot_dir
        .map(std::path::absolute)
        .transpose()
        .map_err(io("resolve the snapshot directory"))?;
    for layer in &mut chain.layers {
        if layer.is_relative() {
            // A name in the snapshot's disks/, resolved strictly beneath the snapshot's
            // directory: a symbolic link there that leads out of it is refused.
            let snapshot = snapshot_dir
                .as_deref()
                .ok_or(DiskSetupError::NoSnapshotDir)?;
            let name = snapshot_layer(Path::new(""), layer)?;
            let (_, real) = mayfly_sys::beneath::open(snapshot, &name).map_err(|source| {
                DiskSetupError::LayerUnreadable {
                    layer: layer.clone(),
                    source,
                }
            })?;
            *layer = real;
        } else {
            if let Some((from, to)) = layers_moved {
                if let Ok(rest) = layer.strip_prefix(from) {
                    *layer = to.join(rest);
                }
            }
            if let Some(within) = layers_within {
                *layer = resolve_within(layer, within)?;
            }
        }
    }
    let found = base_identity(&chain.base)?;
    if found != chain.base_identity {
        return Err(DiskSetupError::BaseChanged {
            path: chain.base,
            expected: chain.base_identity,
        });
    }
    if state.read_only {
        return Ok(Disk::open(&chain, true)?);
    }
    let dir = prepare_dir(dir.ok_or(DiskSetupError::NoDiskDir)?)?;
    let top = new_layer_path(&dir, &state.serial)?;
    match chain.layers.last() {
        Some(below) => {
            let info = LayerInfo::read(below)?;
            create_layer(&top, &info)?;
        }
        None => {
            mayfly_devices::disk::create_base_layer(
                &top,
                &chain.base,
                &chain.base_identity,
                Some(state.disk.disk_size),
            )?;
        }
    }
    chain.layers.push(top.clone());
    let disk = match Disk::open(&chain, false) {
        Ok(disk) => disk,
        Err(e) => {
            let _ = std::fs::remove_file(&top);
            return Err(e.into());
        }
    };
    write_manifest(&dir, &state.serial, &disk.chain())?;
    Ok(disk)
}

/// A layer a snapshot names by full path, which must lie in `within`: resolved strictly
/// beneath it (every symbolic link on the way must stay inside), to its real path.
fn resolve_within(layer: &Path, within: &Path) -> Result<PathBuf, DiskSetupError> {
    let outside = || DiskSetupError::LayerOutside {
        layer: layer.to_path_buf(),
        within: within.to_path_buf(),
    };
    let within_real = std::fs::canonicalize(within).map_err(|_| outside())?;
    // The name as written may start with `within` as given or with its real path.
    let rest = layer
        .strip_prefix(within)
        .or_else(|_| layer.strip_prefix(&within_real))
        .map_err(|_| outside())?;
    let (_, real) = mayfly_sys::beneath::open(&within_real, rest).map_err(|_| outside())?;
    Ok(real)
}

/// Freeze `disk` (see [`Disk::freeze`]) onto a new top in `dir`, compacting the frozen chain
/// into one layer when it has grown long, and record the new chain in the manifest.
pub fn freeze(disk: &mut Disk, serial: &str, dir: &Path) -> Result<(), DiskSetupError> {
    let top = new_layer_path(dir, serial)?;
    disk.freeze(&top)?;
    if disk.needs_compaction() {
        let out = new_layer_path(dir, serial)?;
        disk.compact_frozen(&out)?;
    }
    write_manifest(dir, serial, &disk.chain())
}

/// Put the layers of a saved block device into the snapshot being written in `snapshot_tmp`
/// (hard links under `disks/`) and name them relative to the snapshot.
///
/// A layer this process may not link (the kernel's `protected_hardlinks` refuses links to a
/// file of another owner that one cannot write: a jailed VMM restored from a template or a
/// fork base that the sandbox manager keeps root's) stays named by its full path, as a fork's
/// state names layers: such a snapshot is self-contained but for the base and those layers.
pub fn link_into_snapshot(
    state: &mut BlockState,
    snapshot_tmp: &Path,
) -> Result<(), DiskSetupError> {
    let disks = snapshot_tmp.join(SNAPSHOT_DISKS);
    if !state.chain.layers.is_empty() {
        match std::fs::create_dir(&disks) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io(format!("create {}", disks.display()))(e)),
        }
    }
    for layer in &mut state.chain.layers {
        let name = layer
            .file_name()
            .ok_or_else(|| DiskSetupError::BadLayerName(layer.display().to_string()))?
            .to_owned();
        let link = disks.join(&name);
        match std::fs::hard_link(&*layer, &link) {
            Ok(()) => {}
            // Two disks never share a layer file, but a chain could name one twice: the link
            // is there already.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) if e.raw_os_error() == Some(libc::EXDEV) => {
                return Err(DiskSetupError::CrossDevice {
                    snapshot: snapshot_tmp.to_path_buf(),
                    layer: layer.clone(),
                })
            }
            Err(e) if e.raw_os_error() == Some(libc::EPERM) && layer.is_absolute() => continue,
            Err(e) => return Err(io(format!("link {} into the snapshot", layer.display()))(e)),
        }
        *layer = Path::new(SNAPSHOT_DISKS).join(name);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs() {
        assert_eq!(
            "a.img".parse::<DiskSpec>().unwrap(),
            DiskSpec {
                path: "a.img".into(),
                read_only: false
            }
        );
        assert!("/x/a.img,ro".parse::<DiskSpec>().unwrap().read_only);
        assert!("a.img,rw".parse::<DiskSpec>().is_ok());
        assert!("a.img,bogus".parse::<DiskSpec>().is_err());
        assert!(",ro".parse::<DiskSpec>().is_err());
        assert!("".parse::<DiskSpec>().is_err());
    }

    #[test]
    fn serials() {
        assert_eq!(serial(0).unwrap(), "vda");
        assert_eq!(serial(25).unwrap(), "vdz");
        assert!(serial(26).is_err());
    }

    #[test]
    fn snapshot_layer_names_stay_inside_the_snapshot() {
        let snap = Path::new("/s");
        assert_eq!(
            snapshot_layer(snap, Path::new("disks/vda-1.layer")).unwrap(),
            PathBuf::from("/s/disks/vda-1.layer")
        );
        for bad in [
            "disks/../state",
            "../disks/x",
            "disks",
            "disks/a/b",
            "other/x",
            "disks/..",
            "/etc/passwd",
        ] {
            assert!(snapshot_layer(snap, Path::new(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn identity_is_the_content_hash_and_follows_changes() {
        let dir = std::env::temp_dir().join(format!("mayfly-disks-id-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let img = dir.join("base.img");
        std::fs::write(&img, b"abc").unwrap();
        let a = base_identity(&img).unwrap();
        assert_eq!(
            a,
            "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        // The same answer again (from the cache or not).
        assert_eq!(base_identity(&img).unwrap(), a);
        std::fs::write(&img, b"abd").unwrap();
        assert_ne!(base_identity(&img).unwrap(), a);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_fifo_is_not_a_base() {
        let dir = std::env::temp_dir().join(format!("mayfly-disks-fifo-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert!(matches!(
            base_identity(&fifo),
            Err(DiskSetupError::Disk(DiskError::NotAFile { .. }))
        ));
        assert!(matches!(
            base_identity(&dir),
            Err(DiskSetupError::Disk(DiskError::NotAFile { .. })) | Err(DiskSetupError::Io { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
