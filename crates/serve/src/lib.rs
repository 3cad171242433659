//! `mayfly serve`: one control socket for many sandboxes, each still a VMM process of its own.
//!
//! A sandbox is a VM known by name (a DNS label) that the manager starts, puts to sleep when
//! it has been idle for its `idle_timeout_s` (a snapshot into its directory, then its VMM
//! exits and its RAM is freed), and wakes again, transparently, on the next request for it.
//! Requests for a sandbox's VM (exec, files, the VM's own pause, snapshot, network) are
//! passed to its VMM's own control socket as they are, streamed both ways.
//!
//! | request                                 | token   | what                                  |
//! |-----------------------------------------|---------|---------------------------------------|
//! | `GET /sandboxes`                        | admin   | list                                  |
//! | `POST /sandboxes` `{"name", ...spec}`   | admin   | create (a boot, or a restore of `snapshot`); answers its token once |
//! | `GET /sandboxes/NAME`                   | either  | describe                              |
//! | `DELETE /sandboxes/NAME`                | either  | end its VMM, remove everything of it  |
//! | `PUT /sandboxes/NAME/pause`             | either  | suspend to disk now                   |
//! | `PUT /sandboxes/NAME/resume`            | either  | wake now                              |
//! | `POST /sandboxes/NAME/fork`             | admin   | N new sandboxes from one snapshot of it (see `fork.rs`) |
//! | `PUT /sandboxes/NAME/token` `{"ttl_s"}` | admin   | a new token (the old one stops working; it expires after `ttl_s` if given) |
//! | `DELETE /sandboxes/NAME/token`          | admin   | revoke its token                      |
//! | `POST /sandboxes/NAME/credential`       | admin   | a new credential (`{"audience", "ttl_s"}`), the one before stops verifying |
//! | `DELETE /sandboxes/NAME/credential`     | admin   | revoke its credential                 |
//! | any `/sandboxes/NAME/vm...`             | either  | passed to its VMM as `/vm...` (woken first; what it would refuse, refused here) |
//! | `GET /metrics`                          | none    | Prometheus text                       |
//! | `GET /openapi.json`                     | none    | the API's OpenAPI document ([`OPENAPI`]) |
//!
//! "either": the sandbox's own token or the admin token, as `Authorization: Bearer TOKEN`
//! (in the one spelling it was given in). A token holds at most 16 of the manager's 256
//! connections, and the tenants 224 in all (the rest are the admin's); a request passed to a
//! VMM has deadlines, and ends when its client hangs up (see `server.rs` and `routes.rs`).
//! The admin token is in `<state-dir>/admin.token` (mode 0600, made at the first start); the
//! socket itself is mode 0600. What the admin token names for a create (kernel, initrd,
//! rootfs, snapshot) is read only from the images directories (`--images-dir`, see
//! `images.rs`); every VMM runs in a memory cgroup of its guest memory and an allowance,
//! counted so in the memory budget (`cgroup.rs`); its console and log are capped. Everything the manager knows is in the state directory (see
//! `files.rs` and `records.rs`): `kill -9` of the manager loses nothing, and a new one adopts
//! the VMMs that still run, after finishing or undoing what the journal (`journal.rs`) says
//! was in flight. Stopping the manager (SIGTERM, SIGINT) leaves the sandboxes as
//! they are.
//!
//! The modules, each importing only from those listed before it (`scripts/check-module-cycles`
//! holds the line):
//!
//! - below everything: `error` (the error type and its HTTP status), `util`, `cgroup` (each
//!   VMM's memory cgroup), `config` (`mayfly serve`'s options), `tokens`, `events` (the event
//!   log), `images` (where the files a create names may be), `metrics`, `credential` (signing
//!   and checking credentials), `journal` (the intents a crash must not lose: a create, a
//!   VMM's start, a fork, a delete, each finished or undone by the next start);
//! - what a sandbox is: `template` (a template's spec), `records` (a sandbox's spec, state
//!   and record on disk), `files` (its directory), `process` (its VMM process), `budget`
//!   (memory and disk accounting), `sandbox` (the value the manager holds), `listeners` (the
//!   host listeners of its exposed ports);
//! - the manager: `templates` (the template cache and builder), `manager` (the manager and
//!   what it reads), `lifecycle` (the state machine), `recovery` (a manager's start), `idle`
//!   (the idle watch);
//! - on top: `fork`, `openapi`, `ports` (guest ports exposed on the host, kept across
//!   sleep), `routes` (HTTP), `server` (the socket).

// Below everything.
mod cgroup;
mod config;
mod credential;
mod error;
mod events;
mod images;
mod journal;
mod metrics;
mod tokens;
mod util;

// What a sandbox is.
mod budget;
mod files;
mod listeners;
mod process;
mod records;
mod sandbox;
mod template;

// The manager.
mod idle;
mod lifecycle;
mod manager;
mod recovery;
mod templates;

// On top.
mod fork;
mod netpool;
mod openapi;
mod ports;
mod routes;
mod server;

pub use config::{
    absolute_state_dir, CrashPoint, NetPoolConfig, Policy, ServeConfig, DEFAULT_CONSOLE_LIMIT,
    DEFAULT_VMM_ALLOWANCE_MIB,
};
pub use error::ServeError;
pub use openapi::{OPENAPI, ROUTES};
pub use records::DEFAULT_MEM_MIB;
pub use server::serve;
