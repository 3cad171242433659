//! User lookup from /etc/passwd and /etc/group. The agent is statically linked, so glibc's
//! NSS (getpwnam and friends) is not available: the files are parsed here.

use std::fs;
use std::path::Path;

/// Who a program runs as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Account {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: String,
    pub shell: String,
    /// Supplementary groups, the primary one included.
    pub groups: Vec<u32>,
}

struct PasswdEntry<'a> {
    name: &'a str,
    uid: u32,
    gid: u32,
    home: &'a str,
    shell: &'a str,
}

/// `name:password:uid:gid:gecos:home:shell`; comments, blank and malformed lines skipped.
fn passwd_entries(text: &str) -> impl Iterator<Item = PasswdEntry<'_>> {
    text.lines().filter_map(|line| {
        if line.starts_with('#') {
            return None;
        }
        let f: Vec<&str> = line.split(':').collect();
        if f.len() < 7 || f[0].is_empty() {
            return None;
        }
        Some(PasswdEntry {
            name: f[0],
            uid: f[2].parse().ok()?,
            gid: f[3].parse().ok()?,
            home: f[5],
            shell: f[6],
        })
    })
}

/// The groups `user` belongs to: its primary group plus every `/etc/group` line listing
/// it (`name:password:gid:member,member`).
fn groups_of(group_text: &str, user: &str, primary: u32) -> Vec<u32> {
    let mut groups = vec![primary];
    for line in group_text.lines() {
        let f: Vec<&str> = line.split(':').collect();
        if f.len() < 4 {
            continue;
        }
        let Ok(gid) = f[2].parse::<u32>() else {
            continue;
        };
        if f[3].split(',').any(|m| m.trim() == user) && !groups.contains(&gid) {
            groups.push(gid);
        }
    }
    groups
}

/// Finds a user by name or numeric uid (a name made of digits is tried as a name first,
/// then as a uid).
pub fn lookup(etc: &Path, user: &str) -> Result<Account, String> {
    let passwd = fs::read_to_string(etc.join("passwd")).unwrap_or_default();
    if let Some(e) = passwd_entries(&passwd).find(|e| e.name == user) {
        let group = fs::read_to_string(etc.join("group")).unwrap_or_default();
        return Ok(Account {
            name: e.name.to_owned(),
            uid: e.uid,
            gid: e.gid,
            home: e.home.to_owned(),
            shell: e.shell.to_owned(),
            groups: groups_of(&group, e.name, e.gid),
        });
    }
    match user.parse::<u32>() {
        Ok(uid) => Ok(by_uid(etc, uid)),
        Err(_) => Err(format!(
            "no such user: {user} (not in {})",
            etc.join("passwd").display()
        )),
    }
}

/// Finds a user by numeric uid; a uid without a passwd entry runs with gid = uid, home `/`.
pub fn by_uid(etc: &Path, uid: u32) -> Account {
    let passwd = fs::read_to_string(etc.join("passwd")).unwrap_or_default();
    let group = fs::read_to_string(etc.join("group")).unwrap_or_default();
    let found = passwd_entries(&passwd).find(|e| e.uid == uid);
    match found {
        Some(e) => Account {
            name: e.name.to_owned(),
            uid: e.uid,
            gid: e.gid,
            home: e.home.to_owned(),
            shell: e.shell.to_owned(),
            groups: groups_of(&group, e.name, e.gid),
        },
        None => Account {
            name: uid.to_string(),
            uid,
            gid: uid,
            home: "/".into(),
            shell: String::new(),
            groups: vec![uid],
        },
    }
}

/// The account the agent itself runs as, for HOME and USER when no user is asked for.
pub fn current(etc: &Path) -> Account {
    // SAFETY: getuid cannot fail and has no memory effects.
    let uid = unsafe { libc::getuid() };
    let mut account = by_uid(etc, uid);
    if uid == 0 && account.home == "/" {
        // No passwd entry for root (a bare image): still give root its usual home.
        account.name = "root".into();
        account.home = "/root".into();
    }
    account
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/bash\n\
        # a comment\n\
        daemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n\
        broken line\n\
        1000:x:1001:1001::/home/digits:/bin/sh\n\
        alice:x:1000:1000:Alice,,,:/home/alice:/bin/sh\n";
    const GROUP: &str = "root:x:0:\nwheel:x:10:bob,alice\naudio:x:29:alice\nalice:x:1000:\n";

    fn etc() -> tempdir::Dir {
        tempdir::Dir::with(&[("passwd", PASSWD), ("group", GROUP)])
    }

    /// A throwaway directory for the lookup tests (no dev-dependency needed for this).
    mod tempdir {
        use std::path::{Path, PathBuf};
        pub struct Dir(PathBuf);
        impl Dir {
            pub fn with(files: &[(&str, &str)]) -> Dir {
                use std::sync::atomic::{AtomicU32, Ordering};
                static N: AtomicU32 = AtomicU32::new(0);
                let dir = std::env::temp_dir().join(format!(
                    "mayfly-users-{}-{}",
                    std::process::id(),
                    N.fetch_add(1, Ordering::Relaxed)
                ));
                std::fs::create_dir_all(&dir).unwrap();
                for (name, text) in files {
                    std::fs::write(dir.join(name), text).unwrap();
                }
                Dir(dir)
            }
            pub fn path(&self) -> &Path {
                &self.0
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    #[test]
    fn by_name_with_groups() {
        let d = etc();
        let a = lookup(d.path(), "alice").unwrap();
        assert_eq!((a.uid, a.gid), (1000, 1000));
        assert_eq!(a.home, "/home/alice");
        assert_eq!(a.groups, vec![1000, 10, 29]);
    }

    #[test]
    fn by_uid_and_digit_names() {
        let d = etc();
        assert_eq!(lookup(d.path(), "0").unwrap().name, "root");
        // "1000" is a user's name here: the name wins over uid 1000 (alice).
        assert_eq!(lookup(d.path(), "1000").unwrap().home, "/home/digits");
        let unknown = lookup(d.path(), "4242").unwrap();
        assert_eq!(
            (unknown.uid, unknown.gid, unknown.home.as_str()),
            (4242, 4242, "/")
        );
    }

    #[test]
    fn unknown_name_is_an_error() {
        let d = etc();
        let e = lookup(d.path(), "mallory").unwrap_err();
        assert!(e.contains("no such user: mallory"), "{e}");
    }
}
