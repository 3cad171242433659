//! The seed's package index for tests: a PEP 503 index with one small wheel
//! (`mayfly-demo-stats`), and the DNS server that names it (`pypi.test`), both served by
//! tests/fixtures/package-index.py inside a test's own internet namespace
//! ([`crate::netns::TestNet::with_internet`]). The demo runs the same script.

/// The test's package index and the DNS server that names it (tests/fixtures/package-index.py),
/// run in the test's internet namespace; killed when dropped. A decoy server listens on TCP
/// port 80 of the DNS server's address: reachable, were a policy to allow it.
pub struct PackageIndex {
    child: std::process::Child,
    log: std::path::PathBuf,
}

impl PackageIndex {
    pub const NAME: &'static str = "pypi.test";
    pub const HTTP: std::net::Ipv4Addr = std::net::Ipv4Addr::new(198, 51, 100, 1);
    pub const DNS: std::net::Ipv4Addr = std::net::Ipv4Addr::new(198, 51, 100, 53);

    pub fn start(dir: &crate::guest::TestDir, net: &crate::netns::TestNet) -> PackageIndex {
        use std::io::BufRead;
        let internet = &net.internet.as_ref().expect("a test internet").internet;
        let log = dir.join("index.log");
        let mut child = crate::netns::command_in(internet, "python3")
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/fixtures/package-index.py"
            ))
            .args(["--root", &dir.arg("index"), "--name", Self::NAME])
            .args(["--http", &format!("{}:80", Self::HTTP)])
            .args(["--dns", &format!("{}:53", Self::DNS)])
            .args(["--log", &log.to_string_lossy()])
            .args(["--decoy", &format!("{}:80", Self::DNS)])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("python3 runs the package index (scripts/setup.sh installs python3)");
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line, "ready\n", "the package index did not start");
        PackageIndex { child, log }
    }

    /// The index's requests so far: (client address, path).
    pub fn requests(&self) -> Vec<(String, String)> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .map(|l| {
                let mut f = l.split(' ');
                let who = f.next().unwrap_or_default().to_string();
                (who, f.nth(1).unwrap_or_default().to_string())
            })
            .collect()
    }
}

impl Drop for PackageIndex {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
