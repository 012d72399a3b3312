//! `gpuvisor-sim`: a FUSE filesystem that simulates an NVIDIA GPU host's sysfs/devfs tree
//! (docs/design/host.md §10) for gpuvisor's end-to-end tests.
//!
//! - [`model`]: host models (TOML of §10.2) and presets (§10.7).
//! - [`state`]: the host state and the driver rules (§10.3), handle tracking (§10.4) and the
//!   state dump (§10.6).
//! - [`ctl`]: the control channel (§10.5).
//! - [`fs`]: the FUSE adapter.
//! - [`testing`]: [`SimMount`], a mount for other crates' tests.

pub mod ctl;
pub mod fs;
pub mod model;
pub mod state;
pub mod testing;
pub mod tree;

pub use testing::SimMount;

/// The line `gpuvisor-sim mount` prints once the mount is usable (followed by the directory).
pub const READY_PREFIX: &str = "gpuvisor-sim: ready ";
